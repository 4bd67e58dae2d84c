"""Where checkpoints live: the directory, the file names in it, and their positions.

``ckpt-{epoch}.keras`` is saved after an epoch (the Keras guides' naming) and
``ckpt-{epoch}-{batch}.keras`` after ``batch`` batches of epoch ``epoch`` (1-based, like
Keras's ``{epoch}``/``{batch}``).

Example:
    >>> checkpoint_name(2, 50), parse_checkpoint_name("ckpt-3-50.keras")
    ('ckpt-3-50.keras', Position(epoch=2, batch=50))
"""

from __future__ import annotations

import os
import re
import tempfile

from tfdist import saving, validate
from tfdist.position import Position

__all__ = [
    "CORRUPT_SUFFIX",
    "checkpoint_name",
    "parse_checkpoint_name",
    "list_checkpoints",
    "check_dir",
]

_NAME_RE = re.compile(r"^ckpt-(\d+)(?:-(\d+))?\.keras$")
# Suffix given to a checkpoint that does not load, so that it is kept for inspection but
# neither restored nor counted (or pruned) as a checkpoint again.
CORRUPT_SUFFIX = ".corrupt"


def checkpoint_name(epoch: int, batch: int = 0) -> str:
    """The file name of the checkpoint ``batch`` batches into 0-based epoch ``epoch``.

    Example:
        >>> checkpoint_name(1), checkpoint_name(2, 50)
        ('ckpt-1.keras', 'ckpt-3-50.keras')
    """
    epoch = validate.non_negative_int(epoch, "epoch", "checkpoint_name")
    batch = validate.non_negative_int(batch, "batch", "checkpoint_name")
    return f"ckpt-{epoch}.keras" if batch == 0 else f"ckpt-{epoch + 1}-{batch}.keras"


def parse_checkpoint_name(name: str) -> Position | None:
    """The position a checkpoint file name stands for, or None for other names.

    Example:
        >>> parse_checkpoint_name("ckpt-3-50.keras")
        Position(epoch=2, batch=50)
        >>> parse_checkpoint_name("notes.txt") is None
        True
    """
    match = _NAME_RE.match(name)
    if not match:
        return None
    epoch, batch = int(match.group(1)), match.group(2)
    if batch is None:
        return Position(epoch, 0)
    if epoch < 1 or int(batch) < 1:
        return None
    return Position(epoch - 1, int(batch))


def list_checkpoints(checkpoint_dir: str | os.PathLike) -> list[tuple[Position, str]]:
    """The checkpoints in a directory as (position, path), oldest first.

    Staging files, quarantined ``.corrupt`` files and other names are ignored; a missing
    directory has none.

    Example:
        >>> list_checkpoints("ckpt/")  # doctest: +SKIP
        [(Position(epoch=1, batch=0), 'ckpt/ckpt-1.keras')]
    """
    directory = os.fspath(checkpoint_dir)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        position = parse_checkpoint_name(name)
        path = os.path.join(directory, name)
        if position is not None and os.path.isfile(path):
            found.append((position, path))
    return sorted(found)


def check_dir(checkpoint_dir, where: str, *, writable: bool) -> str:
    """The absolute checkpoint directory; on the chief (``writable``) created and probed.

    Raises:
        TypeError, ValueError: not a path, or an empty one.
        NotADirectoryError: it is a file (left untouched).
        PermissionError: ``writable`` and this process cannot create files in it.

    Example:
        >>> check_dir("ckpt/", "make_or_restore", writable=False).endswith("ckpt")
        True
    """
    text = validate.path_text(checkpoint_dir, "checkpoint_dir", where)
    directory = os.path.abspath(text)
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise NotADirectoryError(
            f"{where}: checkpoint_dir is a file, not a directory. "
            f"Received: checkpoint_dir={text!r}. Pass a directory "
            "path (it is created when missing); the file was left untouched."
        )
    if writable:
        _probe_writable(directory, text, where)
    return directory


def _probe_writable(directory: str, text: str, where: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        # A real write, not os.access: permission bits do not tell the whole story
        # (read-only mounts, root, ACLs). The name is a staging name of this process, so
        # a crash here leaves nothing that the next start does not clean up.
        staging = saving.staging_path(os.path.join(directory, "probe"), saving.WriteRole())
        fd, probe = tempfile.mkstemp(prefix=os.path.basename(staging) + "-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise PermissionError(
            f"{where}: checkpoint_dir is not writable ({err.strerror or err}). "
            f"Received: checkpoint_dir={text!r}. Pass a directory this "
            "process can create files in; nothing in it was changed."
        ) from None
