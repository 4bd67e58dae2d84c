"""What a corpus script leaves behind when ``CORPUS_OUT`` names a folder; nothing otherwise.

Each script's last lines call ``save``: the final weights of its main model(s), its logged
history, its outputs (predictions, scores) and the number of replicas each model trained on,
to ``CORPUS_OUT/<script>-<RANK>.npz`` (``RANK``: the process's rank under ``tfdist launch``,
0 elsewhere). ``load`` reads one back as nested dicts for tests/scripts/equivalence.py.
"""

import os

import numpy as np

OUT_ENV = "CORPUS_OUT"


def replicas(model) -> int:
    """The replicas ``model`` trained on: its strategy's (TensorFlow) or the devices its
    variables live on (JAX)."""
    import keras

    if keras.backend.backend() == "tensorflow":
        return model.distribute_strategy.num_replicas_in_sync
    return len(model.weights[0].value.sharding.device_set)


def save(script, models, history=None, outputs=()):
    out = os.environ.get(OUT_ENV)
    if not out:
        return
    models = list(models) if isinstance(models, (list, tuple)) else [models]
    found = {"replicas": np.array([replicas(model) for model in models])}
    for i, model in enumerate(models):
        for j, weight in enumerate(model.get_weights()):
            found[f"weights/{i}/{j}"] = np.asarray(weight)
    for key, values in (getattr(history, "history", history) or {}).items():
        found[f"history/{key}"] = np.asarray(values, dtype=np.float64)
    for i, output in enumerate(outputs):
        found[f"outputs/{i}"] = np.asarray(output)
    name = os.path.splitext(os.path.basename(script))[0]
    os.makedirs(out, exist_ok=True)
    np.savez(os.path.join(out, f"{name}-{os.environ.get('RANK', '0')}.npz"), **found)


def load(path) -> dict:
    """One record as ``{"replicas": [...], "weights": {...}, "history": {...}, "outputs": {...}}``."""
    with np.load(path) as data:
        found: dict = {"weights": {}, "history": {}, "outputs": {}}
        for key in data.files:
            if key == "replicas":
                found["replicas"] = [int(n) for n in data[key]]
            else:
                group, rest = key.split("/", 1)
                found[group][rest] = data[key]
    return found
