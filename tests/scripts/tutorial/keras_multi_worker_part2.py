# The official TensorFlow tutorial "Multi-worker training with Keras"
# (https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras), its second
# half ("Multi-worker training in depth": dataset sharding, model saving and loading,
# checkpoint saving and restoring, the BackupAndRestore callback), run as one script on
# every worker, as main.py runs the first half. The setup lines come from the first half.
#
# Changes, each marked "Changed" below:
# - Every '/tmp/...' path is under the directory given as the first argument (default
#   /tmp), so that concurrent runs do not share files.
# - model_path ends in ".keras": Keras 3 refuses `model.save('/tmp/keras-model')`
#   ("ValueError: Invalid filepath extension for saving. Please add either a `.keras`
#   extension for the native Keras format (recommended) or a `.h5` extension."); the
#   tutorial's own note recommends the .keras format.
# - One all-reduce before `tf.keras.models.load_model(model_path)`: without it the other
#   worker races the chief's save (Keras 3's model.save does not wait for the workers).
# - The tutorial's "Evaluation" and "Performance" sections have no code.
# MNIST comes from mnist_setup.py (tensorflow_datasets, TFDS_DATA_DIR, never downloaded).
import json
import os
import sys

import mnist_setup
import tensorflow as tf

root = sys.argv[1] if len(sys.argv) > 1 else "/tmp"  # Changed: see above.

# From the first half: the setup every cell below relies on.
per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])

strategy = tf.distribute.MultiWorkerMirroredStrategy()

batch_size = 64
single_worker_dataset = mnist_setup.mnist_dataset(batch_size)

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_setup.mnist_dataset(global_batch_size)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()

# ### Dataset sharding
options = tf.data.Options()
options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF

global_batch_size = 64
multi_worker_dataset = mnist_setup.mnist_dataset(batch_size=64)
dataset_no_auto_shard = multi_worker_dataset.with_options(options)

# ### Model saving and loading
model_path = os.path.join(root, "keras-model.keras")  # Changed: '/tmp/keras-model'


def _is_chief(task_type, task_id):
    # Note: there are two possible `TF_CONFIG` configurations.
    #   1) In addition to `worker` tasks, a `chief` task type is use;
    #      in this case, this function should be modified to
    #      `return task_type == 'chief'`.
    #   2) Only `worker` task type is used; in this case, worker 0 is
    #      regarded as the chief. The implementation demonstrated here
    #      is for this case.
    # For the purpose of this Colab section, the `task_type` is `None` case
    # is added because it is effectively run with only a single worker.
    return (task_type == "worker" and task_id == 0) or task_type is None


def _get_temp_dir(dirpath, task_id):
    base_dirpath = "workertemp_" + str(task_id)
    temp_dir = os.path.join(dirpath, base_dirpath)
    tf.io.gfile.makedirs(temp_dir)
    return temp_dir


def write_filepath(filepath, task_type, task_id):
    dirpath = os.path.dirname(filepath)
    base = os.path.basename(filepath)
    if not _is_chief(task_type, task_id):
        dirpath = _get_temp_dir(dirpath, task_id)
    return os.path.join(dirpath, base)


task_type, task_id = (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id)
write_model_path = write_filepath(model_path, task_type, task_id)

multi_worker_model.save(write_model_path)

if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(os.path.dirname(write_model_path))

# Changed (added): Keras 3's model.save does not wait for the other workers, so another
# worker can reach load_model before the chief has written model_path ("ValueError: File
# not found"). One all-reduce makes every worker wait until the chief's save is done.
strategy.reduce("SUM", strategy.run(lambda: tf.constant(1.0)), axis=None)

loaded_model = tf.keras.models.load_model(model_path)

# Now that the model is restored, and can continue with the training.
loaded_model.fit(single_worker_dataset, epochs=2, steps_per_epoch=20)

# ### Checkpoint saving and restoring
checkpoint_dir = os.path.join(root, "ckpt")  # Changed: '/tmp/ckpt'

checkpoint = tf.train.Checkpoint(model=multi_worker_model)
write_checkpoint_dir = write_filepath(checkpoint_dir, task_type, task_id)
checkpoint_manager = tf.train.CheckpointManager(
    checkpoint, directory=write_checkpoint_dir, max_to_keep=1
)

checkpoint_manager.save()
if not _is_chief(task_type, task_id):
    tf.io.gfile.rmtree(write_checkpoint_dir)

latest_checkpoint = tf.train.latest_checkpoint(checkpoint_dir)
checkpoint.restore(latest_checkpoint)
multi_worker_model.fit(multi_worker_dataset, epochs=2, steps_per_epoch=20)

# #### The `BackupAndRestore` callback
backup_dir = os.path.join(root, "backup")  # Changed: '/tmp/backup'

# Multi-worker training with `MultiWorkerMirroredStrategy`
# and the `BackupAndRestore` callback. The training state
# is backed up at epoch boundaries by default.

callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir)]
with strategy.scope():
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()
multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70, callbacks=callbacks)

# The training state is backed up at epoch boundaries because `save_freq` is
# set to `epoch`.

callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir)]
with strategy.scope():
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()
multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70, callbacks=callbacks)

# The training state is backed up at every 30 steps because `save_freq` is set
# to an integer value of `30`.

callbacks = [tf.keras.callbacks.BackupAndRestore(backup_dir=backup_dir, save_freq=30)]
with strategy.scope():
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()
multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70, callbacks=callbacks)
