"""The elastic Ray Train script of docs/elastic.md, its workers logging each attempt.

    python ray_elastic_driver.py SCRIPT LOG MAX_WORKERS PACE_BELOW STORAGE

Runs SCRIPT (the docs' code block) as its own ``__main__``, the Ray driver, with
``STORAGE`` as its argument. Its trainer runs the script's ``train_loop_per_worker`` in
``logged``, which adds one callback to the loop's ``fit``: after the first step of each
worker group, the chief appends one JSON line to LOG (the group's size, the step it
resumed from, the time of that first step); and while the group has fewer workers than
MAX_WORKERS, every step waits PACE_BELOW seconds, so that a run on the survivors is still
training when a node joins again (the weights do not depend on it).
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
import time

import keras


class _Attempts(keras.callbacks.Callback):
    def __init__(self, log: str, max_workers: int, pace_below: float, from_step: int):
        super().__init__()
        self.log, self.max_workers, self.from_step = log, max_workers, from_step
        self.pace_below = pace_below
        self.logged = False

    def on_train_batch_end(self, batch, logs=None):
        import ray.train

        import tfdist

        context = ray.train.get_context()
        if not self.logged:
            self.logged = True
            if tfdist.is_chief():
                line = {
                    "pid": os.getpid(),
                    "workers": tfdist.num_workers(),
                    "replicas": tfdist.num_replicas(),
                    "from_step": self.from_step,
                    "first_step_at": time.time(),
                }
                with open(self.log, "a") as out:
                    out.write(json.dumps(line) + "\n")
        if context.get_world_size() < self.max_workers:
            time.sleep(self.pace_below)


def logged(log: str, max_workers: int, pace_below: float, loop, config) -> None:
    """``loop(config)`` in a Ray worker, its attempts logged to ``log``."""
    import tfdist

    make_or_restore = tfdist.make_or_restore

    def make_or_restore_logged(*args, **kwargs):
        model, initial_epoch = make_or_restore(*args, **kwargs)
        from_step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        fit = model.fit

        def fit_logged(*fit_args, callbacks=(), **fit_kwargs):
            attempts = _Attempts(log, max_workers, pace_below, from_step)
            return fit(*fit_args, callbacks=[*callbacks, attempts], **fit_kwargs)

        model.fit = fit_logged
        return model, initial_epoch

    tfdist.make_or_restore = make_or_restore_logged  # the loop calls tfdist.make_or_restore
    loop(config)


def main() -> None:
    script, log = sys.argv[1], os.path.abspath(sys.argv[2])
    max_workers, pace_below = int(sys.argv[3]), float(sys.argv[4])
    import ray_elastic_driver  # this file as a module: Ray's workers import logged by name
    from ray.train import tensorflow

    class LoggedTrainer(tensorflow.TensorflowTrainer):
        def __init__(self, train_loop_per_worker, *args, **kwargs):
            loop = functools.partial(ray_elastic_driver.logged, log, max_workers, pace_below)
            super().__init__(functools.partial(loop, train_loop_per_worker), *args, **kwargs)

    tensorflow.TensorflowTrainer = LoggedTrainer  # what the script imports
    sys.argv = [script, *sys.argv[5:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
