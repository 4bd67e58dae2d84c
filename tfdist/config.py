"""The public face of tfdist's knobs: ``tfdist.config.<name>`` for every name below.

The knobs live in ``tfdist.core.config`` (everything else stands on them, so they sit on
the floor); this module gives users their one public route to the same objects.

Example:
    >>> from tfdist import config
    >>> config.cpu_devices(environ={"TFDIST_CPU_DEVICES": "2"})
    2
"""

from __future__ import annotations

from tfdist.core import config as _config
from tfdist.core.config import *  # noqa: F403 - the public names, exactly core.config's __all__
from tfdist.core.config import ConfigError  # noqa: F401 - listed once, as tfdist.ConfigError

__all__ = list(_config.__all__)
