"""What ``tfdist check``'s hook reads of the script's models and writes for the check.

The models' ``BatchNormalization`` and random layers (and the re-runs' switches on
them), their weights as ``{variable path: array}``, this process's progress and result
files in ``TFDIST_CHECK_DIR`` (``rank-R.progress``, ``rank-R.npz``, ``rank-R.json``),
and the wait for every process's result. Used by ``hook`` (fit) and ``loop`` (a
custom loop).

Example:
    >>> write_result(final, initial, first, {"history": {}}, steps=5)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

__all__ = [
    "DIR_ENV",
    "STEPS_ENV",
    "SYNC_BN_ENV",
    "INERT_RANDOM_ENV",
    "all_layers",
    "model_facts",
    "progress",
    "values",
    "wait_for_peers",
    "write_result",
]

DIR_ENV = "TFDIST_CHECK_DIR"
STEPS_ENV = "TFDIST_CHECK_STEPS"
SYNC_BN_ENV = "TFDIST_CHECK_SYNC_BN"
INERT_RANDOM_ENV = "TFDIST_CHECK_INERT_RANDOM"
_PEERS_WAIT_S = 60.0


def _rank() -> int:
    from tfdist.core import cluster

    info = cluster.cluster_from_env()
    if not info.is_multi_worker:
        return 0
    return int(os.environ.get("RANK", info.task_index or 0))


def _world() -> int:
    from tfdist.core import cluster

    return cluster.cluster_from_env().num_workers


def _path(suffix: str) -> Path:
    return Path(os.environ[DIR_ENV]) / f"rank-{_rank()}.{suffix}"


def progress(state: str, **facts) -> None:
    """Overwrites this process's progress file (read by the check when it times out)."""
    _path("progress").write_text(json.dumps({"state": state, "pid": os.getpid(), **facts}))


def model_facts(models: list) -> dict:
    """The models' BatchNormalization and random layers, after the re-run's switches
    (``TFDIST_CHECK_SYNC_BN``, ``TFDIST_CHECK_INERT_RANDOM``) are applied to them: they
    take effect when the training step is traced, after this call."""
    # Each layer once (a Sequential and the functional model it holds share theirs).
    batchnorm = list({id(x): x for m in models for x in _batchnorm_layers(m)}.values())
    if os.environ.get(SYNC_BN_ENV) == "1":
        for layer in batchnorm:
            layer.synchronized = True
    drawing = list({id(x): x for m in models for x in _random_layers(m)}.values())
    inert = os.environ.get(INERT_RANDOM_ENV) == "1"
    made = [_make_inert(layer) for layer in drawing] if inert else []
    return {
        "batchnorm": [layer.name for layer in batchnorm],
        # A frozen BatchNormalization (trainable=False) normalises with its moving
        # statistics in training too (Keras 3): no replica's batch changes it.
        "unsynchronized": [
            layer.name for layer in batchnorm if not layer.synchronized and layer.trainable
        ],
        "random": [layer.name for layer in drawing if _draws(layer)],
        # Models that draw in their own train_step (a GAN's latent vectors): no layer to
        # make inert, but the same per-replica draws.
        "random_steps": sorted({m.name for m in models if _holds_a_seed_generator(m)}),
        "inert": [layer.name for layer, done in zip(drawing, made, strict=False) if done],
    }


def all_layers(model) -> list:
    """The model's layers, through the public ``layers`` of nested models."""
    found, todo = [], list(getattr(model, "layers", ()))
    while todo:
        layer = todo.pop(0)
        found.append(layer)
        todo.extend(getattr(layer, "layers", ()))
    return found


def _batchnorm_layers(model) -> list:
    """The model's BatchNormalization layers."""
    import keras

    return [x for x in all_layers(model) if isinstance(x, keras.layers.BatchNormalization)]


def _random_layers(model) -> list:
    """The model's layers that draw random numbers in training: those holding a
    ``keras.random.SeedGenerator`` (Keras's dropouts, noises and random augmentations,
    and a custom layer built the same way)."""
    return [layer for layer in all_layers(model) if _holds_a_seed_generator(layer)]


def _holds_a_seed_generator(layer) -> bool:
    """Whether a layer or model holds a ``keras.random.SeedGenerator`` as an attribute."""
    import keras

    return any(isinstance(v, keras.random.SeedGenerator) for v in vars(layer).values())


def _draws(layer) -> bool:
    """Whether a random layer draws at all in training: a ``rate`` or ``stddev`` of 0
    (``Dropout(0)``, ``GaussianNoise(0)``) draws nothing, so no replica can differ by it."""
    for name in ("rate", "stddev"):
        value = getattr(layer, name, None)
        if isinstance(value, int | float) and value == 0:
            return False
    return True


def _make_inert(layer) -> bool:
    """Makes ``layer`` draw nothing: its ``call`` runs in inference mode (Dropout and
    GaussianNoise are then the identity, a random augmentation its deterministic
    inference form). Read when fit traces its step; False when ``call`` takes no
    ``training`` argument (nothing to switch)."""
    import inspect

    original = layer.call
    if "training" not in inspect.signature(original).parameters:
        return False

    def call(*args, **kwargs):
        kwargs["training"] = False  # Keras passes the training flag; this wins
        return original(*args, **kwargs)

    layer.call = call  # the instance's attribute: Layer.__call__ calls self.call
    return True


def values(variables) -> dict:
    """``{variable path: numpy array}``; a repeated path gets ``#2``, ``#3``..."""
    import keras
    import numpy as np

    out: dict = {}
    for variable in variables:
        key = variable.path
        n = 1
        while key in out:
            n += 1
            key = f"{variable.path}#{n}"
        # The Keras variable, not its value: inside a strategy's scope (a process-default
        # strategy too) NumPy cannot read a scalar MirroredVariable ("object __array__
        # method not producing an array", a Normalization layer's count), the variable it can.
        out[key] = np.asarray(keras.ops.convert_to_numpy(variable))
    return out


def write_result(final: dict, initial: dict | None, first: dict, facts: dict, steps: int) -> None:
    """This process's result: the weights after the steps, before the first and after
    it (``rank-R.npz``), and the facts with ``steps`` (``rank-R.json``)."""
    import numpy as np

    arrays = {f"final/{k}": v for k, v in final.items()}
    arrays.update({f"initial/{k}": v for k, v in (initial or {}).items()})
    arrays.update({f"first/{k}": v for k, v in first.items()})
    tmp = _path("tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, _path("npz"))
    _atomic_text(_path("json"), json.dumps({**facts, "steps": steps, "world": _world()}))
    progress("done", step=steps)


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_for_peers() -> None:
    """Until every process of the job wrote its result: all left their collectives."""
    world = _world()
    folder = Path(os.environ[DIR_ENV])
    deadline = time.monotonic() + _PEERS_WAIT_S
    while time.monotonic() < deadline:
        if all((folder / f"rank-{r}.json").exists() for r in range(world)):
            return
        time.sleep(0.05)
