"""The first step of an epoch on TensorFlow: tf.distribute's data iterators end promptly.

Under a tf.distribute strategy, Keras's ``fit`` feeds the replicas through an
``OwnedMultiDeviceIterator``: one iterator over the user's pipeline on the host, plus one
small dataset per device that takes its share. Keras drops each epoch's iterators at the
next epoch's first step, on the main thread, and destroying a tf.data iterator waits for
its autotuning thread, which sleeps in a timed wait that the destructor's cancellation
does not cut short. Measured (tools/bench_epoch_start.py, 2 logical CPU devices): first
steps of 1.6 to 26 s against a median step of 0.05-0.08 s; py-spy shows the main thread in
``EagerTensor_dealloc -> ... ~MultiDeviceIterator -> ~RootDataset::Iterator ->
~LogicalThreadWrapper`` (the host pipeline's iterator) and, with autotuning off in the
pipeline only, in the same wait under each per-device iterator.

The fix ``tf_multi_device_iterators_end_promptly`` switches tf.data's autotuning off in the
datasets a multi-device iterator iterates:

* the per-device datasets tf.distribute builds (a fixed one-element prefetch: nothing there
  to tune, only the thread);
* the user's pipeline as the iterator sees it, unless the user chose
  ``options.autotune.enabled`` themselves (then it is left as set). Without the autotuner,
  ``num_parallel_calls=tf.data.AUTOTUNE`` runs at tf.data's default parallelism (the
  machine's cores) and ``prefetch(tf.data.AUTOTUNE)`` keeps its own buffer tuning.

Elements, their order and so training are unchanged (tested exactly); the dataset Keras sees
is the user's own (its length, its options). Fit without a strategy is not touched.

Every private name used comes from ``tfdist.core.upstream``.
"""

from __future__ import annotations

from tfdist.core import upstream
from tfdist.core.fix_registry import Fix, on_tensorflow_backend, patch, targets

__all__ = [
    "TF_MULTI_DEVICE_ITERATORS_END_PROMPTLY",
    "FIXES",
    "tf_multi_device_iterators_end_promptly",
    "without_autotuning",
]

TF_MULTI_DEVICE_ITERATORS_END_PROMPTLY = "tf_multi_device_iterators_end_promptly"


def without_autotuning(dataset, *, unless_chosen: bool = False):
    """``dataset`` with tf.data's autotuning off (or unchanged when ``unless_chosen`` and
    its options already say whether to autotune).

    Example:
        >>> import tensorflow as tf  # doctest: +SKIP
        >>> without_autotuning(tf.data.Dataset.range(3)).options().autotune.enabled  # doctest: +SKIP
        False
    """
    import tensorflow as tf

    if unless_chosen and dataset.options().autotune.enabled is not None:
        return dataset
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def tf_multi_device_iterators_end_promptly() -> None:
    """Turns tf.data's autotuning off in what tf.distribute's multi-device iterator reads.

    Keras's ``fit`` destroys the previous epoch's ``OwnedMultiDeviceIterator`` on the main
    thread at the next epoch's first step, and tf.data's iterator destructor waits for the
    autotuning thread of every iterator inside it (the host pipeline's and one per
    device): first steps of seconds to tens of seconds. Without autotuning there is no
    such thread. The per-device datasets (``_create_device_dataset``: a fixed one-element
    prefetch) have nothing to tune; the user's pipeline, as the iterator receives it, is
    left as it is when its options set ``autotune.enabled`` (the user chose). Elements and
    their order do not depend on autotuning, so training is unchanged (tested exactly).
    """
    module = upstream.tf_multi_device_iterator_module()

    def make_init(original):
        def __init__(self, dataset=None, *args, **kwargs):
            if dataset is not None:  # None: rebuilt from components (nothing to iterate)
                dataset = without_autotuning(dataset, unless_chosen=True)
            original(self, dataset, *args, **kwargs)

        return __init__

    def make_device_dataset(original):
        def _create_device_dataset(*args, **kwargs):
            return without_autotuning(original(*args, **kwargs))

        return _create_device_dataset

    patch(
        module.OwnedMultiDeviceIterator,
        "__init__",
        TF_MULTI_DEVICE_ITERATORS_END_PROMPTLY,
        make_init,
    )
    patch(
        module,
        "_create_device_dataset",
        TF_MULTI_DEVICE_ITERATORS_END_PROMPTLY,
        make_device_dataset,
    )


_MDI = "tensorflow.python.data.ops.multi_device_iterator_ops:"

FIXES = [
    Fix(
        TF_MULTI_DEVICE_ITERATORS_END_PROMPTLY,
        "tf.distribute's multi-device data iterator waits for tf.data's autotuning threads "
        "when it is destroyed, which Keras fit does at each epoch's first step: first steps "
        "of seconds to tens of seconds (median step 0.05 s)",
        on_tensorflow_backend(),
        tf_multi_device_iterators_end_promptly,
        package="tensorflow",
        targets=targets(
            _MDI + "OwnedMultiDeviceIterator.__init__",
            _MDI + "_create_device_dataset",
        ),
        acts_where=(
            "every tf.distribute multi-device data iterator, any strategy (an autotune "
            "setting the user chose is kept); fit without a strategy: untouched"
        ),
        no_harm=(
            "tests/compat/test_no_harm.py::test_every_case_equals_one_device_with_the_fixes",
            "tests/compat/test_upstream_keras.py::test_keras_tests_fail_with_the_fixes_only_where_they_fail_without[tensorflow]",
        ),
    ),
]
