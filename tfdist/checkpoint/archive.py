"""A checkpoint archive's bytes: tfdist's resume metadata member and the end-to-end check.

Each ``.keras`` checkpoint carries ``tfdist/resume.json`` (Keras ignores members it does
not know): the position (epoch, batches done), the global step and the dropout RNG state,
which ``.keras``/``.weights.h5`` files leave out. Before a restore the whole archive is
read back and every member's CRC checked, so a truncated or damaged file is skipped
instead of half loaded.

Example:
    >>> read_resume_metadata("ckpt/ckpt-3-50.keras")["batch"]  # doctest: +SKIP
    50
"""

from __future__ import annotations

import json
import os
import time
import zipfile

import keras

from tfdist import saving
from tfdist.position import Position

__all__ = [
    "RESUME_MEMBER",
    "FORMAT_VERSION",
    "CorruptCheckpoint",
    "resume_metadata",
    "write_resume_metadata",
    "read_resume_metadata",
    "inspect_archive",
]

RESUME_MEMBER = "tfdist/resume.json"
FORMAT_VERSION = 1


class CorruptCheckpoint(Exception):
    """The archive cannot be read back (truncated, bad CRC, missing members)."""


def resume_metadata(position: Position, *, step: int, rng: list, replicas: int) -> dict:
    """The content of ``tfdist/resume.json`` for a save at ``position`` after ``step``.

    Example:
        >>> resume_metadata(Position(2, 50), step=250, rng=[], replicas=2)["batch"]
        50
    """
    return {
        "format": FORMAT_VERSION,
        "epoch": position.epoch,
        "batch": position.batch,
        "step": step,
        "rng": rng,
        "replicas": replicas,
        "keras": keras.__version__,
        "saved_at": time.time(),
    }


def write_resume_metadata(archive_path: str, meta: dict) -> None:
    """Adds ``meta`` as ``tfdist/resume.json`` to a ``.keras`` archive being staged."""
    saving.add_archive_member(archive_path, RESUME_MEMBER, json.dumps(meta).encode())


def read_resume_metadata(path: str | os.PathLike) -> dict | None:
    """The ``tfdist/resume.json`` of a checkpoint archive, or None when it has none.

    Example:
        >>> read_resume_metadata("ckpt/ckpt-3-50.keras")["step"]  # doctest: +SKIP
        250
    """
    data = saving.read_archive_member(os.fspath(path), RESUME_MEMBER)
    return None if data is None else json.loads(data.decode("utf-8"))


def inspect_archive(path: str) -> dict:
    """Checks a checkpoint's bytes end to end: ``{"config": ..., "resume": meta or None}``.

    Raises:
        CorruptCheckpoint: a member fails its CRC, Keras's members are missing, or the
            archive or its resume metadata does not parse.

    Example:
        >>> inspect_archive("ckpt/ckpt-3.keras")["resume"]["epoch"]  # doctest: +SKIP
        3
    """
    try:
        with zipfile.ZipFile(path, "r") as zf:
            config, meta = _read_members(zf)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, ValueError) as err:
        raise CorruptCheckpoint(f"{type(err).__name__}: {err}") from None
    if meta is not None and not (
        isinstance(meta, dict)
        and isinstance(meta.get("epoch"), int)
        and isinstance(meta.get("batch"), int)
    ):
        raise CorruptCheckpoint(f"{RESUME_MEMBER} is malformed: {meta!r}")
    return {"config": config, "resume": meta}


def _read_members(zf: zipfile.ZipFile) -> tuple[dict, object]:
    bad = zf.testzip()  # reads every member and checks its CRC
    if bad is not None:
        raise CorruptCheckpoint(f"member {bad!r} fails its CRC check")
    names = set(zf.namelist())
    missing = {"config.json", "model.weights.h5"} - names
    if missing:
        raise CorruptCheckpoint(f"missing {sorted(missing)}")
    config = json.loads(zf.read("config.json").decode("utf-8"))
    meta = None
    if RESUME_MEMBER in names:
        meta = json.loads(zf.read(RESUME_MEMBER).decode("utf-8"))
    return config, meta
