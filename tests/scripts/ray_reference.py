"""One device for tests/e2e/test_ray.py: the Ray Train script's loop without Ray.

Runs ``train_loop_per_worker`` of the script named on the command line (the code block
of docs/ray.md) in this process, with no cluster (one replica) and Ray's
``report`` a no-op; its checkpoints land in OWN_DIR, the last one ``ckpt-3.keras``. The
JAX script's ``join_jax_job`` (which asks Ray for the coordinator) only picks the backend.

    python ray_reference.py ray_train.py OWN_DIR
"""

import importlib.util
import os
import sys

import ray.train

script, own_dir = sys.argv[1:3]
spec = importlib.util.spec_from_file_location("ray_train", script)
ray_train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ray_train)
ray.train.report = lambda *args, **kwargs: None  # no Ray session in this process
if hasattr(ray_train, "join_jax_job"):
    ray_train.join_jax_job = lambda: os.environ.update(KERAS_BACKEND="jax")
ray_train.train_loop_per_worker({"checkpoints": own_dir})
