"""The Ray Train script of docs/ray.md with a fault injected, for tests/e2e/test_ray.py.

    python ray_faults.py SCRIPT FAULT STORAGE

Runs SCRIPT (the docs' ``TensorflowTrainer`` code block) as its own ``__main__``, the Ray
driver, with ``STORAGE`` as its argument; the trainer it builds runs the script's
``train_loop_per_worker`` in ``with_fault``, which sets ``TFDIST_TEST_FAULT=FAULT``
(tests/scripts/faults.py) in each worker first. The one fault it honours:

- ``nan``: at the end of the last epoch, before the loop's checkpoint callback saves, one
  weight of each worker's model becomes NaN, so the run's last checkpoint holds it.

Not ``outside_distribution``: the loop reports what its process runs on, not its model,
so only the weights would tell, and each fault is a trainer run of its own (about 40 s);
not ``one_device``: each worker has one device already.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys

import faults
import keras


class _NaNAtTheEnd(keras.callbacks.Callback):
    """Puts a NaN in the last layer's kernel when the last epoch ends (the callbacks after
    it, the loop's own, save and report that model)."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.params["epochs"]:
            kernel = self.model.layers[-1].kernel
            value = keras.ops.convert_to_numpy(kernel.value).copy()
            value.flat[0] = float("nan")
            kernel.assign(value)


def with_fault(fault: str, loop, config) -> None:
    """``loop(config)`` in a Ray worker, with ``fault`` injected."""
    os.environ[faults.VARIABLE] = fault
    import tfdist

    if faults.active("nan"):
        make_or_restore = tfdist.make_or_restore

        def with_nan_at_the_end(*args, **kwargs):
            model, initial_epoch = make_or_restore(*args, **kwargs)
            fit = model.fit

            def fit_with_nan(*fit_args, callbacks=(), **fit_kwargs):
                return fit(*fit_args, callbacks=[_NaNAtTheEnd(), *callbacks], **fit_kwargs)

            model.fit = fit_with_nan
            return model, initial_epoch

        tfdist.make_or_restore = with_nan_at_the_end  # the loop calls tfdist.make_or_restore
    loop(config)


def main() -> None:
    script, fault = sys.argv[1], sys.argv[2]
    if fault != "nan":
        sys.exit(f"ray_faults.py honours the fault 'nan' only, not {fault!r}")
    import ray_faults  # this file as a module: Ray's workers import with_fault by name
    from ray.train import tensorflow

    class FaultyTrainer(tensorflow.TensorflowTrainer):
        def __init__(self, train_loop_per_worker, *args, **kwargs):
            loop = functools.partial(ray_faults.with_fault, fault, train_loop_per_worker)
            super().__init__(loop, *args, **kwargs)

    tensorflow.TensorflowTrainer = FaultyTrainer  # what the script imports
    sys.argv = [script, *sys.argv[3:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
