"""What each model of a test job ran on, read from the model itself.

A job's process-level report (``tfdist.num_replicas()``) says what the process *could*
run on; a model built outside the distribution still trains on one device. ``install()``
wraps Keras's ``fit`` / ``evaluate`` / ``predict`` and ``*_on_batch`` so that, after each
call, the model's own topology is noted: its strategy's replicas and workers on
TensorFlow, the devices and processes holding its first variable on JAX. A job clears
``NOTED`` before each case and reports it with the case's result; the test asserts it.

    import trained_on
    trained_on.install()
    trained_on.NOTED.clear(); run_case(); result["trained_on"] = list(trained_on.NOTED)
"""

from __future__ import annotations

import keras

NOTED: list[dict] = []  # the current case's models, after each call, without repeats
METHODS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")


def model_topology(model) -> dict:
    """``{"replicas": R, "workers": W}`` of what ``model`` runs on."""
    if keras.backend.backend() == "jax":
        devices = model.weights[0].value.sharding.device_set
        return {"replicas": len(devices), "workers": len({d.process_index for d in devices})}
    strategy = model.distribute_strategy
    replicas = strategy.num_replicas_in_sync
    try:
        local = len(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy: this process's one device
        local = replicas
    return {"replicas": replicas, "workers": replicas // local}


def _noting(method):
    def call(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        if self.weights and (found := model_topology(self)) not in NOTED:
            NOTED.append(found)
        return out

    call.noting = True  # type: ignore[attr-defined]
    return call


def install() -> None:
    """Wraps the Keras calls once per process."""
    for name in METHODS:
        method = getattr(keras.Model, name)
        if not getattr(method, "noting", False):
            setattr(keras.Model, name, _noting(method))


def emit(tag: str, result: dict) -> None:
    """Prints ``TAG {json}`` as one whole line, however long.

    ``print`` under ``PYTHONUNBUFFERED`` hands a long line to one ``write`` and drops what
    a partial write leaves (measured: a 57 KB result line cut at 4.6 KB when the pipe to
    the launcher was full); this writes until every byte is out.
    """
    import json
    import os
    import sys

    data = f"{tag} {json.dumps(result)}\n".encode()
    sys.stdout.flush()
    view = memoryview(data)
    while view:
        view = view[os.write(sys.stdout.fileno(), view) :]
