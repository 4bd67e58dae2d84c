"""A model's input on several workers or processes: one shuffle order, whole batches,
the user's arrays left as they are. The TensorFlow fixes are in ``inputs.tensorflow``
(a ``PyDataset`` or a generator under ``MultiWorkerMirroredStrategy``), the JAX fixes in
``inputs.jax`` (numpy, ``PyDataset`` and generators over several JAX processes).

Example:
    >>> from tfdist.compat.inputs import tensorflow
    >>> sorted(fix.name for fix in tensorflow.FIXES)
    ['keras_tf_generator_batches_copied', 'keras_tf_workers_agree_shuffle']
"""
