"""What the reference process measures on ``fit``'s first batch, after ``fit``.

``split``: whether the model's forward pass and loss change when the batch is split in
replica parts (the ``batch_sum`` cause). ``gradient_rms``: each trainable variable's
gradient on that batch (the tolerance's zero-signal rule, ``verdict``).

On TensorFlow each of R replicas runs the model and its loss on its own part of the
global batch. A model whose ``call`` mixes the examples of a batch (``ops.sum`` or
``ops.mean`` over the batch axis, a ``tensordot`` across it), or a loss that is not a
sum or mean of per-example terms as Keras combines them, then trains another model
than one device. After ``fit``, the reference process evaluates both on its first
batch: whole, and split as ``tf.distribute`` splits it (contiguous parts whose sizes
differ by at most one). The figures are the ``batch_sum`` cause's evidence.

Keras combines the replicas' losses as follows (``keras.src.losses.loss.reduce_values``):
a loss that reduces per-example values by a mean is scaled by ``1 / R`` (by each
replica's share with tfdist's fixes) and the replicas' gradients are summed, so the
combination is the mean of the parts' losses; a loss whose values are already a
scalar, or whose reduction is ``"sum"``, is not scaled, so the parts' losses are summed.

Example:
    >>> split(model, x, y, None, (2, 4))  # doctest: +SKIP
    {'2': {'outputs': 0.0, 'loss': 1.0}, '4': {'outputs': 0.0, 'loss': 3.0}}
"""

from __future__ import annotations

from tfdist import backends

__all__ = ["SPLITS", "gradient_rms", "read", "split"]

# Replica counts measured: the check's topologies' usual ones.
SPLITS = (2, 3, 4, 8)


def read(args: tuple, kwargs: dict):
    """``(x, y, sample_weight)`` of ``fit``'s first batch as numpy arrays, or None: arrays
    given to ``fit`` (their first ``batch_size`` rows), or a ``tf.data`` input's first
    element (read through a new iterator, after ``fit``)."""
    import keras
    import numpy as np

    names = ("x", "y", "batch_size")
    given = {**dict(zip(names, args, strict=False)), **kwargs}
    x = given.get("x")
    tf = _tensorflow()
    if tf is not None and isinstance(x, tf.data.Dataset):
        element = next(iter(x))
        data = keras.utils.unpack_x_y_sample_weight(element)
    elif isinstance(x, np.ndarray | dict | list | tuple):
        size = given.get("batch_size") or 32  # Keras's default for arrays
        data = (x, given.get("y"), given.get("sample_weight"))
        data = keras.tree.map_structure(lambda a: None if a is None else a[:size], data)
    else:
        return None  # a generator, a PyDataset: not read again
    return keras.tree.map_structure(lambda a: None if a is None else np.asarray(a), data)


def _tensorflow():
    import sys

    return sys.modules.get("tensorflow")


def split(model, x, y, sample_weight, splits=SPLITS) -> dict:
    """``{R: {"outputs": o, "loss": l}}``: the largest change of the model's outputs
    (relative to their largest magnitude) and of the loss as Keras combines it (relative
    to the whole batch's), when the batch is split in R parts; ``loss`` is None when the
    model's compiled loss is not one Keras loss or function."""
    import keras
    import numpy as np

    size = len(keras.tree.flatten(x)[0])
    whole = _outputs(model, x)
    loss = _loss(model)
    whole_loss = loss(y, whole, sample_weight) if loss and y is not None else None
    found = {}
    for count in (r for r in splits if 1 < r <= size):
        bounds = np.cumsum([0, *(len(p) for p in np.array_split(np.arange(size), count))])
        parts = [
            _part((x, y, sample_weight), a, b) for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        outputs = [_outputs(model, px) for px, _, _ in parts]
        joined = keras.tree.map_structure(lambda *leaves: np.concatenate(leaves, axis=0), *outputs)
        found[str(count)] = {
            "outputs": _relative(whole, joined),
            "loss": None
            if whole_loss is None
            else _loss_change(loss, whole_loss, parts, outputs, size),
        }
    return found


def _part(data, start: int, stop: int):
    import keras

    return keras.tree.map_structure(lambda a: None if a is None else a[start:stop], data)


def _outputs(model, x):
    import keras

    return keras.tree.map_structure(keras.ops.convert_to_numpy, model(x, training=False))


def _relative(whole, joined) -> float:
    import keras
    import numpy as np

    worst = 0.0
    for a, b in zip(keras.tree.flatten(whole), keras.tree.flatten(joined), strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(a))), 1e-12))
    return worst


def _loss(model):
    """``loss(y, y_pred, sample_weight) -> (value, summed)``: the compiled loss reduced
    as Keras reduces it, and whether Keras sums the replicas' values (a scalar loss, a
    ``"sum"`` reduction) rather than averaging them; None for several losses."""
    import keras
    import numpy as np

    given = getattr(model, "loss", None)
    if given is None or isinstance(given, dict | list | tuple):
        return None
    fn = keras.losses.get(given) if isinstance(given, str) else given
    if not callable(fn):
        return None
    if isinstance(fn, keras.losses.Loss):
        per_example, reduction = fn.call, fn.reduction
    else:
        per_example, reduction = fn, "sum_over_batch_size"  # Keras wraps a function so
    if reduction in (None, "none"):
        return None

    def reduced(y, y_pred, sample_weight):
        values = np.asarray(keras.ops.convert_to_numpy(per_example(y, y_pred)), np.float64)
        if values.ndim and sample_weight is not None:
            shape = (-1,) + (1,) * (values.ndim - 1)
            values = values * np.reshape(np.asarray(sample_weight, np.float64), shape)
        summed = values.ndim == 0 or reduction == "sum"
        return float(np.sum(values) if summed else np.mean(values)), summed

    return reduced


def _loss_change(loss, whole, parts, outputs, size: int) -> float:
    """How far the replicas' combined loss is from the whole batch's (relative)."""
    value, summed = whole
    combined = 0.0
    for (_, y, weight), y_pred in zip(parts, outputs, strict=True):
        part, _ = loss(y, y_pred, weight)
        combined += part if summed else part * len(y) / size
    return abs(combined - value) / max(abs(value), 1e-12)


def gradient_rms(model, x, y, sample_weight) -> dict:
    """``{variable path: root mean square of its gradient}``: the compiled loss's gradient
    on the batch in training mode (BatchNormalization on the batch's statistics), at the
    weights after ``fit``; {} where the backend is not TensorFlow or JAX."""
    import keras
    import numpy as np

    variables = model.trainable_variables
    backend = backends.name()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        grads = tape.gradient(loss, variables)
    elif backend == "jax":
        import jax

        def loss_of(trainable, non_trainable):
            y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
            return model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)

        grads = jax.grad(loss_of)(
            [v.value for v in variables], [v.value for v in model.non_trainable_variables]
        )
    else:
        return {}
    found = {}
    for variable, grad in zip(variables, grads, strict=True):
        g = np.zeros(1) if grad is None else np.asarray(keras.ops.convert_to_numpy(grad))
        found[variable.path] = float(np.sqrt(np.mean(np.square(g.astype(np.float64)))))
    return found
