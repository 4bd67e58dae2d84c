"""Sharded, asynchronous checkpoints on JAX: each process writes its own shards (Orbax).

``tfdist.callbacks.checkpoint(dir, sharded=True)`` (and a custom loop's
``tfdist.loops.Checkpointer(..., sharded=True)``) writes ``ckpt-{epoch}.orbax`` and
``ckpt-{epoch}-{batch}.orbax`` directories instead of ``.keras`` archives. The model's
weights and the optimizer's variables are saved as they lie on the devices (an
``orbax.checkpoint`` PyTree: every process writes the shards it holds, nothing is
gathered to one process), and the write runs in a background thread after the arrays
are copied to host memory, so training goes on while the files are written. On disk,
Orbax writes into ``<name>.orbax-checkpoint-tmp`` and renames it when every process has
finished, so a directory with a checkpoint's name is a complete checkpoint; a killed job
leaves only a temporary directory, removed by the chief at the next start. In a bucket
(``s3://``, ``gs://``: ``tfdist.checkpoint.remote_orbax``), where a rename copies every
object, Orbax writes under the final name and writes ``commit_success.txt`` last: only a
directory holding it is a checkpoint; one without it is a killed job's write, removed by
the chief at the next start.

``make_or_restore`` (and ``Checkpointer.restore``) reads these directories as it reads
archives (newest first, a damaged one skipped and renamed ``*.corrupt``, every worker
agreeing) and restores each array with the sharding the freshly built model gives it: a
checkpoint saved on a 2x2 mesh restores on 4x1, on one device or on another process count
(Orbax reshards). The resume position, global step and dropout RNG state travel in the
checkpoint's JSON item, as in archives.

JAX only: Orbax saves ``jax.Array``s. TensorFlow models keep the ``.keras`` archives.

Example:
    >>> sharded_name(2, 50)
    'ckpt-3-50.orbax'
    >>> callback = tfdist.callbacks.checkpoint("ckpt/", sharded=True)  # doctest: +SKIP
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
from typing import Any

from tfdist import backends
from tfdist.checkpoint import remote_orbax
from tfdist.checkpoint.archive import CorruptCheckpoint
from tfdist.checkpoint.names import checkpoint_name, parse_checkpoint_name
from tfdist.core import storage
from tfdist.core.position import Position

__all__ = [
    "SUFFIX",
    "sharded_name",
    "parse_sharded_name",
    "sharded_entries",
    "stale_writes",
    "remove_stale_writes",
    "prune_sharded",
    "check_sharded_target",
    "saved_variables",
    "ShardedWriter",
    "read_sharded",
    "variable_table",
]

logger = logging.getLogger(__name__)

SUFFIX = ".orbax"
_BUCKETS = ("s3://", "gs://")  # the URLs Orbax (tensorstore) writes to
FORMAT_VERSION = "tfdist-sharded/1"
# Orbax's name for a checkpoint being written (renamed to the final name once finished).
_ORBAX_TMP = ".orbax-checkpoint-tmp"


def sharded_name(epoch: int, batch: int = 0) -> str:
    """The directory name of the sharded checkpoint ``batch`` batches into ``epoch``.

    Example:
        >>> sharded_name(1), sharded_name(2, 50)
        ('ckpt-1.orbax', 'ckpt-3-50.orbax')
    """
    return checkpoint_name(epoch, batch).removesuffix(".keras") + SUFFIX


def parse_sharded_name(name: str) -> Position | None:
    """The position a sharded checkpoint's name stands for, or None for other names.

    Example:
        >>> parse_sharded_name("ckpt-3-50.orbax")
        Position(epoch=2, batch=50)
        >>> parse_sharded_name("ckpt-3.orbax.orbax-checkpoint-tmp") is None
        True
    """
    if not name.endswith(SUFFIX):
        return None
    # The archives' naming rule, with the sharded suffix.
    return parse_checkpoint_name(name.removesuffix(SUFFIX) + ".keras")


def _named(checkpoint_dir: str) -> list[tuple[Position, str, bool]]:
    """``(position, path, committed)`` of every entry with a sharded checkpoint's name.

    On disk the name is the commit (Orbax renames a finished write onto it); in a bucket
    it is Orbax's ``commit_success.txt`` inside, written last.
    """
    found = []
    for name in storage.listdir(checkpoint_dir):
        position = parse_sharded_name(name)
        if position is not None:
            path = storage.join(checkpoint_dir, name)
            committed = not storage.is_url(path) or storage.exists(
                storage.join(path, remote_orbax.COMMIT_MARKER)
            )
            found.append((position, path, committed))
    return found


def sharded_entries(checkpoint_dir: str) -> list[tuple[Position, str]]:
    """Finished sharded checkpoints (and anything else with their name on disk), oldest
    first. In a bucket only committed ones (``commit_success.txt`` inside).

    Example:
        >>> sharded_entries("/no/such/dir")
        []
    """
    return sorted((position, path) for position, path, done in _named(checkpoint_dir) if done)


def stale_writes(checkpoint_dir: str) -> list[str]:
    """Writes that never finished (a killed job's): Orbax's temporary directories on
    disk, checkpoint directories without ``commit_success.txt`` in a bucket.

    Example:
        >>> stale_writes("/no/such/dir")
        []
    """
    if storage.is_url(checkpoint_dir):
        return sorted(path for _, path, done in _named(checkpoint_dir) if not done)
    return sorted(
        os.path.join(checkpoint_dir, name)
        for name in storage.listdir(checkpoint_dir)
        if _ORBAX_TMP in name and name.startswith("ckpt-")
    )


def remove_stale_writes(checkpoint_dir: str) -> list[str]:
    """Removes the writes a killed job left unfinished (the chief calls it before restoring).

    Example:
        >>> remove_stale_writes("/no/such/dir")
        []
    """
    stale = stale_writes(checkpoint_dir)
    for path in stale:
        logger.warning("tfdist: removing %s, a checkpoint write that never finished", path)
        remove_tree(path)
    return stale


def prune_sharded(checkpoint_dir: str, max_to_keep: int | None) -> None:
    """Removes the oldest finished sharded checkpoints beyond ``max_to_keep`` (None: none).

    Example:
        >>> prune_sharded("/no/such/dir", 5)
    """
    if max_to_keep is None:
        return
    found = sharded_entries(checkpoint_dir)
    for _position, path in found[: max(len(found) - max_to_keep, 0)]:
        remove_tree(path)


def check_sharded_target(checkpoint_dir: str, where: str) -> None:
    """Sharded checkpoints need the JAX backend and ``orbax-checkpoint``; a directory
    may be local or an ``s3://`` / ``gs://`` URL.

    Raises:
        ValueError: another Keras backend, or a URL of another scheme.
        ImportError: ``orbax-checkpoint`` is not installed.

    Example:
        >>> check_sharded_target("ckpt/", "tfdist.callbacks.checkpoint")  # doctest: +SKIP
    """
    if storage.is_url(checkpoint_dir) and not checkpoint_dir.lower().startswith(_BUCKETS):
        raise ValueError(
            f"{where}: sharded checkpoints go to a local (or mounted) directory or an "
            f"s3:// or gs:// URL (Orbax writes there through tensorstore). Received: "
            f"checkpoint_dir={checkpoint_dir!r}. Use one of those, or sharded=False "
            "(archives go through any fsspec URL)."
        )
    if not backends.get().saves_sharded():
        raise ValueError(
            f"{where}: sharded=True needs the JAX backend (Orbax saves jax.Array shards). "
            f"Received: sharded=True with KERAS_BACKEND={backends.name()!r}. Use "
            "sharded=False (.keras archives) on TensorFlow, or set KERAS_BACKEND=jax."
        )
    _orbax(where)


def _orbax(where: str = "tfdist.checkpoint.sharded"):
    try:
        import orbax.checkpoint as ocp
    except ImportError as err:
        raise ImportError(
            f"{where}: sharded checkpoints need orbax-checkpoint, which is not installed "
            f"({err}). Install it with: pip install 'tfdist[jax]' (or pip install "
            "orbax-checkpoint)."
        ) from None
    return ocp


def saved_variables(model, optimizer=None) -> list:
    """The variables a sharded checkpoint holds, in its order: the model's weights, then
    the optimizer's variables (``optimizer``: a custom loop's, which the model, not
    compiled, does not hold; by default ``model.optimizer``).

    Example:
        >>> variables = saved_variables(model, optimizer)  # doctest: +SKIP
    """
    optimizer = model.optimizer if optimizer is None else optimizer
    return [*model.weights, *optimizer.variables]


def variable_table(variables) -> list[list]:
    """``[path, shape, dtype]`` of every saved variable (``saved_variables``' list).

    Written into each checkpoint, so that a restore tells a model that does not fit (another
    architecture or optimizer: other shapes, dtypes or count) from a damaged checkpoint.
    """
    return [[v.path, list(v.shape), str(v.dtype)] for v in variables]


class ShardedWriter:
    """Writes sharded checkpoints in the background, one at a time.

    ``save`` returns once the arrays are copied off the devices (the previous write is
    finished first); ``wait`` blocks until the last write is finished and renamed.

    The write is made cheap for the training it runs beside (measured with
    ``tools/bench_sharded.py``, see docs/checkpoints.md): no compression (zstd took a third
    of a save's processor time and held compressed copies in memory, for 8% less disk on
    trained float weights), each replicated array written whole by its first replica (no
    per-replica slicing dispatched in the save call), and tensorstore's writer threads at
    a lower scheduling priority than training.

    Example:
        >>> writer = ShardedWriter()                          # doctest: +SKIP
        >>> writer.save(saved_variables(model), "ckpt/ckpt-1.orbax", {"epoch": 1, ...})  # doctest: +SKIP
        >>> writer.wait()                                     # doctest: +SKIP
    """

    def __init__(self):
        self._ocp = _orbax()
        # One Orbax checkpointer per kind of target: renamed on disk, committed by a
        # marker in a bucket (made at the first save there).
        self._checkpointers: dict[bool, Any] = {}
        self._checkpointer = self._for(False)

    def _for(self, in_bucket: bool):
        if in_bucket not in self._checkpointers:
            ocp = self._ocp
            atomicity = remote_orbax.atomicity_options() if in_bucket else None
            options = ocp.CompositeOptions(atomicity_options=atomicity)
            handler = ocp.CompositeCheckpointHandler(
                state=_state_handler(ocp),
                meta=ocp.JsonCheckpointHandler(),
                composite_options=options,
            )
            self._checkpointers[in_bucket] = ocp.AsyncCheckpointer(
                handler, atomicity_options=atomicity
            )
        return self._checkpointers[in_bucket]

    def save(self, variables: list, path: str, meta: dict, values: list | None = None) -> None:
        """Starts writing ``variables`` (``saved_variables``) to ``path``; ``values``: the
        arrays to write in their place (a custom loop's train state), by default theirs.

        Every process calls it. Under several processes each value must be a ``jax.Array``
        over the processes' devices (Orbax refuses a process-local one).
        """
        ocp = self._ocp
        self.wait()
        values = [v.value for v in variables] if values is None else list(values)
        if len(values) != len(variables):
            raise ValueError(
                f"ShardedWriter.save: {len(values)} values for {len(variables)} variables. "
                f"Received: path={path!r}. Pass one value per variable, in their order."
            )
        state = {"variables": values}
        meta = dict(meta, format=FORMAT_VERSION, variables=variable_table(variables))
        self._checkpointer = self._for(remote_orbax.prepare(path))
        self._checkpointer.save(
            path,
            args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,  # a save at a position already on disk replaces it, as archives do
        )
        lower_writer_priority()  # the pool's threads exist now (started by the first save)

    def wait(self) -> None:
        for checkpointer in self._checkpointers.values():
            checkpointer.wait_until_finished()
        # The pool may have grown during the write: its new threads are lowered too.
        lower_writer_priority()


def _state_handler(ocp):
    """Orbax's PyTree handler for the arrays, with the options that make a save cheap."""
    import jax

    # Replica-parallel writing slices each replicated array per replica inside the save
    # call (a dispatched op per slice); written whole by replica 0 instead. No array
    # metadata store: it records typed PRNG keys, which Keras variables never are.
    arrays = ocp.type_handlers.ArrayHandler(use_replica_parallel=False, array_metadata_store=None)
    registry = ocp.type_handlers.create_type_handler_registry((jax.Array, arrays))
    # A checkpoint reads back the same with or without compression (zarr records it).
    return ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=registry)


WRITER_NICE = 10
_WRITER_THREADS = ("ts_pool_worker",)  # tensorstore's pool: the copies and file writes


def lower_writer_priority(nice: int | None = None) -> int:
    """Lowers the scheduling priority of tensorstore's writer threads to ``nice``.

    On a machine with few cores the background write competes with training for them;
    at a lower priority it takes what training leaves. Linux only (a thread's nice value);
    elsewhere, and for threads already at ``nice`` or lower priority, nothing happens.
    Returns how many threads were changed.

    Example:
        >>> lower_writer_priority() >= 0
        True
    """
    nice = WRITER_NICE if nice is None else nice
    changed = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() not in _WRITER_THREADS:
                    continue
            if os.getpriority(os.PRIO_PROCESS, int(tid)) < nice:
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                changed += 1
        except OSError:  # the thread ended meanwhile
            continue
    return changed


def read_sharded(path: str, variables: list, where: str = "make_or_restore") -> dict:
    """Reads a sharded checkpoint onto ``variables``' devices (``saved_variables``' list):
    ``{"resume": meta, "arrays": [...]}``.

    Each array is restored with the sharding of its variable (another mesh or process
    count than the one that saved it reshards). Nothing is assigned yet. ``where`` names
    the caller in the error of a checkpoint that does not fit.

    Raises:
        CorruptCheckpoint: the checkpoint does not read back (missing, truncated or
            garbled files, not a directory).
        ValueError: it reads back but was written for another model or optimizer.

    Example:
        >>> read_sharded("ckpt/ckpt-2.orbax", saved_variables(model))["resume"]["epoch"]  # doctest: +SKIP
        2
    """
    ocp = _orbax()
    import jax

    if remote_orbax.prepare(path):
        if not storage.isdir(path):
            raise CorruptCheckpoint("not a directory")
    elif os.path.islink(path) or not os.path.isdir(path):
        raise CorruptCheckpoint("not a directory")
    checkpointer = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    try:
        with reads_finish_before_their_loop_closes():
            meta = checkpointer.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
                "meta"
            ]
        if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
            raise CorruptCheckpoint(f"its metadata is not tfdist's ({str(meta)[:80]})")
    except CorruptCheckpoint:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to read is the checkpoint's
        raise CorruptCheckpoint(f"{type(err).__name__}: {err}") from None
    expected = variable_table(variables)
    saved = meta.get("variables") or []
    # Matched by order, shape and dtype, as .keras archives are, not by path: the same
    # model built again in one process has other layer names ("dense_1"); a match by
    # path skipping what differs is how keras#23251 restored the wrong weights.
    if [row[1:] for row in saved] != [row[1:] for row in expected]:
        raise ValueError(_does_not_fit(path, saved, expected, where))
    target = {
        "variables": [
            jax.ShapeDtypeStruct(v.value.shape, v.value.dtype, sharding=v.value.sharding)
            for v in variables
        ]
    }
    try:
        with reads_finish_before_their_loop_closes():
            restored = checkpointer.restore(
                path, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )["state"]["variables"]
    except Exception as err:  # noqa: BLE001 - the table matched: the files are damaged
        raise CorruptCheckpoint(f"{type(err).__name__}: {str(err)[:300]}") from None
    return {"resume": meta, "arrays": list(restored), "sharded": True}


# Orbax runs each restore in an asyncio loop of its own and closes it as soon as the
# restore raises. With a damaged checkpoint, the first array that fails to read ends the
# restore while the reads of the other arrays (tensorstore futures) are still under way;
# each of them then completes into the closed loop, and tensorstore prints a traceback
# "RuntimeError: Event loop is closed" (13 for the test job's checkpoint cut in half, one
# run in three; every run with a model of 20 arrays). A loop made while
# ``reads_finish_before_their_loop_closes`` is open lets its pending tasks finish first.
_READS_TIMEOUT_S = 60.0


class _FinishingLoop(asyncio.SelectorEventLoop):
    """An event loop that, closed with tasks pending, first lets them finish (a while)."""

    def close(self) -> None:
        pending = [task for task in asyncio.all_tasks(self) if not task.done()]
        if pending and not self.is_running() and not self.is_closed():
            done, _ = self.run_until_complete(asyncio.wait(pending, timeout=_READS_TIMEOUT_S))
            for task in done:
                if not task.cancelled():
                    task.exception()  # the restore's error already says it: read, not logged
        super().close()


class _FinishingPolicy(asyncio.DefaultEventLoopPolicy):
    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        return _FinishingLoop()


@contextlib.contextmanager
def reads_finish_before_their_loop_closes():
    """Event loops made inside (Orbax makes one per restore) finish their pending tasks
    before they close, so that a restore that fails leaves no read to call back into a
    closed loop. Python 3.14 deprecates event loop policies: there it does nothing.

    Example:
        >>> with reads_finish_before_their_loop_closes():
        ...     pass
    """
    if sys.version_info >= (3, 14):
        yield
        return
    previous = asyncio.get_event_loop_policy()
    asyncio.set_event_loop_policy(_FinishingPolicy())
    try:
        yield
    finally:
        asyncio.set_event_loop_policy(previous)


def assign_sharded(variables: list, info: dict) -> None:
    """Assigns the arrays ``read_sharded`` returned to the ``variables`` it read them for."""
    for variable, value in zip(variables, info["arrays"], strict=True):
        variable.assign(value)


# Who reads, and what the checkpoint must fit, in the error of one that does not.
_FITS = {
    "make_or_restore": ("the model build_fn returns", "the build_fn"),
    "tfdist.loops.Checkpointer": ("the loop's model and optimizer", "the model and optimizer"),
}


def _does_not_fit(path: str, saved: list, expected: list, where: str) -> str:
    differences = [
        f"#{i} {mine[0]} {mine[1:]} vs saved {theirs[0]} {theirs[1:]}"
        for i, (mine, theirs) in enumerate(zip(expected, saved, strict=False))  # counts may differ
        if mine[1:] != theirs[1:]
    ]
    fits, wrote = _FITS.get(where, ("the model and optimizer", "the model and optimizer"))
    return (
        f"{where}: sharded checkpoint {path!r} reads back but does not fit {fits} (another "
        f"architecture or optimizer): {differences[:5]} ({len(saved)} variables saved, "
        f"{len(expected)} in the model). Restore with {wrote} that wrote it, or pass a new "
        "checkpoint directory; nothing was deleted."
    )


def remove_tree(path: str) -> None:
    """Removes a sharded checkpoint (or a stale write); gone already is fine."""
    if storage.is_url(path):
        storage.remove(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


__all__ += ["assign_sharded", "remove_tree", "reads_finish_before_their_loop_closes"]
