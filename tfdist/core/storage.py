"""Where files live: local paths as always, or URLs (``gs://``, ``s3://``, ...) through fsspec.

tfdist's checkpoint directories (``tfdist.callbacks.checkpoint``, ``make_or_restore``) and
``tfdist.save``/``load`` paths may be URLs. A path without a scheme (and a ``file://``
URL, which names one) keeps the local behaviour exactly: ``os.path.abspath``, a staging
file in the same directory, fsync and rename. A URL goes through fsspec (TensorFlow-free,
so the same on both Keras backends; ``gs://`` needs ``gcsfs``, ``s3://`` needs ``s3fs``):

* writing: the file is written to local disk first (Keras writes archives through h5py
  and zipfile, which need a local file), uploaded under a hidden staging name next to the
  final one, then moved onto the final name. Atomicity is the store's: where it renames
  (local and most POSIX-like filesystems) a reader sees the old file or the new one; on an
  object store (GCS, S3) the move is a server-side copy, and an object becomes visible
  only once written whole, so the final name never holds a partial file, but the copy
  and the removal of the staging object are two requests: a crash between them leaves a
  staging object, which the next chief removes (``atomic.remove_stale_staging``). A
  directory (a SavedModel) lands object by object: not atomic on object stores.
  Durability is the store's: nothing is fsynced through fsspec (object stores
  acknowledge a write once it is durable; a POSIX filesystem behind a URL may not).
* reading: the file is downloaded once to a temporary local file, checked end to end
  (``tfdist.checkpoint.archive.inspect_archive``) and loaded from the same local bytes,
  so a damaged or truncated object is caught as on local disk.

Example:
    >>> is_url("gs://bucket/run"), is_url("ckpt/"), normalize("file:///tmp/ckpt", "f")
    (True, False, '/tmp/ckpt')
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

from tfdist.core import validate

__all__ = [
    "is_url",
    "normalize",
    "join",
    "basename",
    "dirname",
    "listdir",
    "exists",
    "isdir",
    "isfile",
    "makedirs",
    "remove",
    "move",
    "upload",
    "local_copy",
]

_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a URL handled by fsspec (``file://`` is a local path).

    Example:
        >>> is_url("s3://bucket/ckpt"), is_url("file:///tmp/ckpt"), is_url("/tmp/ckpt")
        (True, False, False)
    """
    match = _URL_RE.match(os.fspath(path))
    return match is not None and match.group(1).lower() != "file"


def normalize(path: str | os.PathLike, where: str, name: str = "path") -> str:
    """A URL without trailing slashes, or the absolute local path (``file://`` stripped).

    Raises:
        TypeError, ValueError: not a path, or an empty one.

    Example:
        >>> normalize("memory://bucket/run/", "f"), normalize("file:///tmp/x", "f")
        ('memory://bucket/run', '/tmp/x')
    """
    text = validate.path_text(path, name, where)
    if is_url(text):
        return text.rstrip("/")
    if text.lower().startswith("file://"):
        text = text[len("file://") :] or "/"
    return os.path.abspath(text)


def join(directory: str, name: str) -> str:
    """``os.path.join`` for local paths, ``/`` for URLs.

    Example:
        >>> join("gs://b/run", "ckpt-1.keras")
        'gs://b/run/ckpt-1.keras'
    """
    if is_url(directory):
        return f"{directory.rstrip('/')}/{name}"
    return os.path.join(directory, name)


def basename(path: str) -> str:
    """The last component of a local path or URL.

    Example:
        >>> basename("gs://b/run/ckpt-1.keras")
        'ckpt-1.keras'
    """
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)


def dirname(path: str) -> str:
    """The parent of a local path or URL.

    Example:
        >>> dirname("gs://b/run/ckpt-1.keras")
        'gs://b/run'
    """
    return path.rstrip("/").rsplit("/", 1)[0] if is_url(path) else os.path.dirname(path)


def _fs(url: str):
    """fsspec's filesystem for ``url`` and the path inside it; a clear error when missing.

    Its cached listings of ``url`` and the folders above are dropped: other processes
    (other workers, tensorstore's writers) change the store behind the cache's back.
    """
    try:
        import fsspec
    except ImportError:
        raise ImportError(
            f"tfdist: a URL path needs fsspec. Received: path={url!r}. Install it with "
            "`pip install fsspec` (plus gcsfs for gs://, s3fs for s3://)."
        ) from None
    try:
        fs, inner = fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as err:
        scheme = url.split("://", 1)[0]
        raise ImportError(
            f"tfdist: fsspec cannot open {scheme}:// URLs here ({err}). Received: "
            f"path={url!r}. Install the filesystem package for it (gcsfs for gs://, s3fs "
            "for s3://), or use a local path."
        ) from None
    fs.invalidate_cache(inner)
    return fs, inner


def listdir(directory: str) -> list[str]:
    """The entry names in ``directory`` (empty when it does not exist or is not one).

    Example:
        >>> listdir("/no/such/dir")
        []
    """
    if not is_url(directory):
        try:
            return os.listdir(directory)
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, path = _fs(directory)
    try:
        entries = fs.ls(path, detail=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    # Some stores list the directory itself among its entries: left out.
    own = path.rstrip("/")
    return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != own]


def exists(path: str) -> bool:
    """Whether anything is at ``path`` (``os.path.lexists`` for local paths)."""
    if not is_url(path):
        return os.path.lexists(path)
    fs, inner = _fs(path)
    return fs.exists(inner)


def isdir(path: str) -> bool:
    """Whether ``path`` is a directory (a prefix with objects below it on object stores)."""
    if not is_url(path):
        return os.path.isdir(path)
    fs, inner = _fs(path)
    return fs.isdir(inner)


def isfile(path: str) -> bool:
    """Whether ``path`` is a file (an object)."""
    if not is_url(path):
        return os.path.isfile(path)
    fs, inner = _fs(path)
    return fs.isfile(inner)


def makedirs(directory: str) -> None:
    """Creates ``directory`` and its parents (a no-op on stores without directories)."""
    if not is_url(directory):
        os.makedirs(directory, exist_ok=True)
        return
    fs, inner = _fs(directory)
    fs.makedirs(inner, exist_ok=True)


def remove(path: str) -> None:
    """Removes a file or a directory tree; a missing one is not an error."""
    if not is_url(path):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
        return
    fs, inner = _fs(path)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(inner, recursive=fs.isdir(inner))


def move(source: str, target: str) -> None:
    """Moves a file: ``os.replace`` locally, fsspec's ``mv`` (copy + delete on object stores)."""
    if not is_url(source):
        os.replace(source, target)
        return
    fs, inner = _fs(source)
    _, target_inner = _fs(target)
    fs.mv(inner, target_inner, recursive=fs.isdir(inner))


def upload(local: str, staging: str, final: str) -> None:
    """Uploads ``local`` (a file or directory) to ``staging``, then moves it onto ``final``.

    The final name is only ever written by the move (see the module docstring for what
    that guarantees on each kind of store); the staging object is removed on failure.

    Example:
        >>> upload("/tmp/m.keras", "gs://b/.tmp-1-h-m.keras", "gs://b/m.keras")  # doctest: +SKIP
    """
    fs, staging_inner = _fs(staging)
    _, final_inner = _fs(final)
    directory = os.path.isdir(local)
    try:
        fs.put(local, staging_inner, recursive=directory)
        if directory and fs.isdir(final_inner):
            fs.rm(final_inner, recursive=True)  # mv would nest it inside the old one
        fs.mv(staging_inner, final_inner, recursive=directory)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(staging_inner, recursive=directory)
        raise


@contextlib.contextmanager
def local_copy(path: str) -> Iterator[str]:
    """A local path holding ``path``'s bytes: ``path`` itself when local, else a download.

    Raises:
        FileNotFoundError: nothing at a URL ``path``.

    Example:
        >>> with local_copy("gs://b/run/ckpt-1.keras") as local:  # doctest: +SKIP
        ...     inspect_archive(local)
    """
    if not is_url(path):
        yield path
        return
    fs, inner = _fs(path)
    with tempfile.TemporaryDirectory(prefix="tfdist-download-") as scratch:
        target = os.path.join(scratch, basename(path))
        if fs.isdir(inner):
            fs.get(inner, target, recursive=True)
        else:
            fs.get_file(inner, target)
        yield target
