"""A griffe extension for the API reference (mkdocs.yml): ``Example:`` reads as ``Examples:``.

tfdist's docstrings head their doctests ``Example:``, as Google's style guide writes it;
griffe's Google parser knows only ``Examples:`` as a section of examples (it renders the
doctests as code), and takes any other title for an admonition of plain text.
"""

from __future__ import annotations

import re

import griffe

EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.M)


class ExampleSections(griffe.Extension):
    """Renames each docstring's ``Example:`` section to ``Examples:`` as it is loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
