"""Where checkpoints live: the directory, the file names in it, and their positions.

``ckpt-{epoch}.keras`` is saved after an epoch (the Keras guides' naming) and
``ckpt-{epoch}-{batch}.keras`` after ``batch`` batches of epoch ``epoch`` (1-based, like
Keras's ``{epoch}``/``{batch}``).

Example:
    >>> checkpoint_name(2, 50), parse_checkpoint_name("ckpt-3-50.keras")
    ('ckpt-3-50.keras', Position(epoch=2, batch=50))
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import struct
import tempfile

from tfdist.core import atomic, storage, validate
from tfdist.core.position import Position

__all__ = [
    "CORRUPT_SUFFIX",
    "checkpoint_name",
    "parse_checkpoint_name",
    "list_checkpoints",
    "checkpoint_entries",
    "quarantine_path",
    "blocked_paths",
    "check_dir",
    "check_save_target",
]

_NAME_RE = re.compile(r"^ckpt-(\d+)(?:-(\d+))?\.keras$")
# Suffix given to a checkpoint that does not load, so that it is kept for inspection but
# neither restored nor counted (or pruned) as a checkpoint again.
CORRUPT_SUFFIX = ".corrupt"
# Linux inode flags (linux/fs.h) that make rename onto / removal of a file fail, even for
# root: chattr +i (immutable) and +a (append only).
_FS_IOC_GETFLAGS = 0x80086601
_IMMUTABLE_FLAGS = 0x00000010 | 0x00000020


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
    found = []
    for position, path in _named_entries(checkpoint_dir):
        if storage.isfile(path):
            found.append((position, path))
    return found


def checkpoint_entries(checkpoint_dir: str | os.PathLike) -> list[tuple[Position, str]]:
    """Every entry with a checkpoint's name but a directory, oldest first: restore candidates.

    Unlike ``list_checkpoints`` it keeps what is not a readable regular file (a dangling
    symlink, a FIFO...), so that a restore can warn about it and move it aside instead of
    silently passing over it.

    Example:
        >>> checkpoint_entries("ckpt/")  # doctest: +SKIP
        [(Position(epoch=1, batch=0), 'ckpt/ckpt-1.keras')]
    """
    found = []
    for position, path in _named_entries(checkpoint_dir):
        if storage.is_url(path) and not storage.isdir(path):
            found.append((position, path))
        elif not (os.path.isdir(path) and not os.path.islink(path)):
            found.append((position, path))
    return found


def _named_entries(checkpoint_dir) -> list[tuple[Position, str]]:
    directory = os.fspath(checkpoint_dir)
    found = []
    for name in storage.listdir(directory):
        position = parse_checkpoint_name(name)
        if position is not None:
            found.append((position, storage.join(directory, name)))
    return sorted(found)


def quarantine_path(path: str) -> str:
    """A free name for a damaged checkpoint kept aside: ``ckpt-3.keras.corrupt`` first.

    Example:
        >>> quarantine_path("/no/such/dir/ckpt-3.keras")
        '/no/such/dir/ckpt-3.keras.corrupt'
    """
    candidate, number = path + CORRUPT_SUFFIX, 1
    while storage.exists(candidate):
        number += 1
        candidate = f"{path}.{number}{CORRUPT_SUFFIX}"
    return candidate


def blocked_paths(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Entries with a checkpoint's name that a save cannot replace nor pruning remove.

    A directory (``os.replace`` of a file onto it fails) and an immutable or append-only
    file (``chattr +i``/``+a``: renames onto it and its removal fail, even for root).
    A symlink is not one: the save replaces the link itself.

    Example:
        >>> blocked_paths("/no/such/dir")
        []
    """
    return [path for _position, path in _named_entries(checkpoint_dir) if _blocks(path)]


def _blocks(path: str) -> bool:
    if storage.is_url(path):  # object stores have no inode flags; a "directory" blocks
        return storage.isdir(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(mode):
        return False
    return stat.S_ISDIR(mode) or _is_immutable(path)


def _is_immutable(path: str) -> bool:
    """Whether the inode flags say immutable or append only (False where unknown)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        flags = fcntl.ioctl(fd, _FS_IOC_GETFLAGS, bytes(8))
    except OSError:  # a filesystem without inode flags
        return False
    finally:
        os.close(fd)
    return bool(struct.unpack("=i", flags[:4])[0] & _IMMUTABLE_FLAGS)


def check_save_target(checkpoint_dir, where: str, *, writable: bool = True) -> str:
    """The absolute checkpoint directory, once nothing in the way of a save was found.

    Call it before training (``on_train_begin``, ``make_or_restore``) so that a save
    that would fail fails now, before any training is lost, naming the path and the fix.
    Every worker checks the entries (the same ones on shared storage, so all fail
    together); the chief (``writable``) also creates and probes the directory.

    Raises:
        NotADirectoryError: ``checkpoint_dir`` is a file.
        PermissionError: ``writable`` and the directory is not writable, or a file with
            a checkpoint's name is immutable.
        IsADirectoryError: a directory has a checkpoint's name.

    Example:
        >>> check_save_target("ckpt/", "on_train_begin").endswith("ckpt")  # doctest: +SKIP
        True
    """
    directory = check_dir(checkpoint_dir, where, writable=writable)
    blocked = blocked_paths(directory)
    if blocked:
        path = blocked[0]
        is_dir = storage.isdir(path)
        kind = "a directory" if is_dir else "immutable (chattr +i or +a)"
        error = IsADirectoryError if is_dir else PermissionError
        raise error(
            f"{where}: {path!r} has a checkpoint's name but is {kind}, so a checkpoint "
            f"saved there would fail after training. Received: checkpoint_dir={directory!r}"
            f" ({len(blocked)} such path(s): {blocked[:5]}). Move it out of the checkpoint "
            "directory (or chattr -i it); nothing was changed."
        )
    return directory


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
    directory = storage.normalize(text, where, "checkpoint_dir")
    if storage.is_url(directory):
        is_file = storage.isfile(directory)
    else:
        is_file = os.path.exists(directory) and not os.path.isdir(directory)
    if is_file:
        raise NotADirectoryError(
            f"{where}: checkpoint_dir is a file, not a directory. "
            f"Received: checkpoint_dir={text!r}. Pass a directory "
            "path (it is created when missing); the file was left untouched."
        )
    if writable:
        _probe_writable(directory, text, where)
    return directory


def _probe_writable(directory: str, text: str, where: str) -> None:
    if storage.is_url(directory):
        _probe_url(directory, text, where)
        return
    try:
        os.makedirs(directory, exist_ok=True)
        # A real write, not os.access: permission bits do not tell the whole story
        # (read-only mounts, root, ACLs). The name is a staging name of this process, so
        # a crash here leaves nothing that the next start does not clean up.
        staging = atomic.staging_path(os.path.join(directory, "probe"), atomic.WriteRole())
        fd, probe = tempfile.mkstemp(prefix=os.path.basename(staging) + "-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        raise PermissionError(
            f"{where}: checkpoint_dir is not writable ({err.strerror or err}). "
            f"Received: checkpoint_dir={text!r}. Pass a directory this "
            "process can create files in; nothing in it was changed."
        ) from None


def _probe_url(directory: str, text: str, where: str) -> None:
    """A URL's chief writes and removes one small staging-named object (stores without
    directories create nothing else), so that missing credentials fail before training."""
    probe = atomic.staging_path(storage.join(directory, "probe"), atomic.WriteRole())
    try:
        storage.makedirs(directory)
        with tempfile.NamedTemporaryFile(prefix="tfdist-probe-") as local:
            storage.upload(local.name, probe, probe + "-landed")
        storage.remove(probe + "-landed")
    except OSError as err:
        raise PermissionError(
            f"{where}: checkpoint_dir is not writable ({err}). Received: checkpoint_dir="
            f"{text!r}. Pass a URL this process can write to (credentials, bucket); nothing "
            "in it was changed."
        ) from None
