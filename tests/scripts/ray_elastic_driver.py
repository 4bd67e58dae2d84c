"""An elastic Ray Train script of docs/elastic.md, its workers logging each attempt.

    python ray_elastic_driver.py SCRIPT LOG MAX_WORKERS PACE_BELOW STORAGE

Runs SCRIPT (a docs code block, TensorFlow's or JAX's) as its own ``__main__``, the Ray driver, with
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


def _attempts(log: str, max_workers: int, pace_below: float, from_step: int):
    """The callback that logs a group's first step and paces the steps of a small group
    (keras imported here: on JAX, only after the loop has named its coordinator)."""
    import keras
    import ray.train

    import tfdist

    class Attempts(keras.callbacks.Callback):
        logged = False

        def on_train_batch_end(self, batch, logs=None):
            context = ray.train.get_context()
            if not self.logged:
                self.logged = True
                if tfdist.is_chief():
                    line = {
                        "pid": os.getpid(),
                        "workers": tfdist.num_workers(),
                        "replicas": tfdist.num_replicas(),
                        "from_step": from_step,
                        "first_step_at": time.time(),
                    }
                    with open(log, "a") as out:
                        out.write(json.dumps(line) + "\n")
            if context.get_world_size() < max_workers:
                time.sleep(pace_below)

    return Attempts()


def _log_attempts(log: str, max_workers: int, pace_below: float) -> None:
    """Makes ``tfdist.make_or_restore`` give a model whose ``fit`` logs its attempt."""
    import keras

    import tfdist

    make_or_restore = tfdist.make_or_restore

    def make_or_restore_logged(*args, **kwargs):
        model, initial_epoch = make_or_restore(*args, **kwargs)
        from_step = int(keras.ops.convert_to_numpy(model.optimizer.iterations))
        fit = model.fit

        def fit_logged(*fit_args, callbacks=(), **fit_kwargs):
            attempts = _attempts(log, max_workers, pace_below, from_step)
            return fit(*fit_args, callbacks=[*callbacks, attempts], **fit_kwargs)

        model.fit = fit_logged
        return model, initial_epoch

    tfdist.make_or_restore = make_or_restore_logged  # the loop calls tfdist.make_or_restore


def logged(log: str, max_workers: int, pace_below: float, loop, config) -> None:
    """``loop(config)`` in a Ray worker, its attempts logged to ``log``. A JAX loop first
    calls its ``join_jax_job`` (keras must not be imported before it): the logging is
    set up right after that call."""
    join = loop.__globals__.get("join_jax_job")
    if join is None:
        _log_attempts(log, max_workers, pace_below)
    else:

        def join_then_log():
            join()
            _log_attempts(log, max_workers, pace_below)

        loop.__globals__["join_jax_job"] = join_then_log
    loop(config)


def main() -> None:
    script, log = sys.argv[1], os.path.abspath(sys.argv[2])
    max_workers, pace_below = int(sys.argv[3]), float(sys.argv[4])
    import ray_elastic_driver  # this file as a module: Ray's workers import logged by name
    from ray.train import tensorflow
    from ray.train.v2 import jax

    def logged_trainer(trainer):
        class LoggedTrainer(trainer):
            def __init__(self, train_loop_per_worker, *args, **kwargs):
                loop = functools.partial(ray_elastic_driver.logged, log, max_workers, pace_below)
                super().__init__(functools.partial(loop, train_loop_per_worker), *args, **kwargs)

        return LoggedTrainer

    # what the scripts import
    tensorflow.TensorflowTrainer = logged_trainer(tensorflow.TensorflowTrainer)
    jax.JaxTrainer = logged_trainer(jax.JaxTrainer)
    sys.argv = [script, *sys.argv[5:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
