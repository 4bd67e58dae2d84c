"""The manual's Reference pages are what tools/docs/reference.py writes from the code:
every TFDIST_* variable of tfdist/core/config.py's table with what its parser takes, each
command's --help as the command prints it, and the public names of tfdist/__init__.py."""

from __future__ import annotations

import pytest

from tools.docs import reference as reference_pages

from conftest import REPO


@pytest.mark.parametrize("page", ["environment.md", "cli.md", "api.md"])
def test_reference_page_is_current(page):
    path = REPO / "docs" / "reference" / page
    expected = reference_pages.pages()[path]
    assert path.read_text() == expected, "run: python -m tools.docs.reference --write"


def test_every_variable_of_the_config_table_is_on_the_settings_page_with_what_it_takes():
    text = (REPO / "docs" / "reference" / "environment.md").read_text()
    rows = [row for row in reference_pages.config_table() if row[0].startswith("TFDIST_")]
    assert len(rows) >= 15
    for name, default, _ in rows:
        row = next(line for line in text.splitlines() if line.startswith(f"| `{name}` |"))
        assert f"| {default} |" in row, row
    assert reference_pages.takes("TFDIST_CPU_DEVICES") == "a positive int"
    assert reference_pages.takes("TFDIST_SHARED_NETWORK") == "1 or 0"


def test_every_command_has_its_help_on_the_commands_page():
    text = (REPO / "docs" / "reference" / "cli.md").read_text()
    found = reference_pages.commands()
    assert {("launch",), ("check",), ("info",), ("train", "mnist")} <= set(found)
    for argv in found:
        assert f"## `{' '.join(('tfdist', *argv))}`" in text
        assert reference_pages.command_help(*argv).rstrip() in text


def test_every_public_name_is_on_the_api_page():
    text = (REPO / "docs" / "reference" / "api.md").read_text()
    import tfdist

    for name in tfdist.__all__:
        if name != "__version__":
            assert f"## `tfdist.{name}`" in text, name
