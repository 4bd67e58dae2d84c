"""What several commands share: the help formatter, and TensorFlow's start-up kept quiet."""

from __future__ import annotations

import argparse

__all__ = ["HelpFormatter", "quiet_tensorflow"]


def quiet_tensorflow() -> None:
    """TensorFlow's C++ start-up chatter and the known-harmless warnings off; errors show."""
    # They would bury the answer (tfdist.core.quiet).
    from tfdist.core import quiet

    quiet.install()


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks; every option's help names its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)"
