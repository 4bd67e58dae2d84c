"""The cross-replica optimizer step that the accumulation and clipping fixes share.

Under a tf.distribute strategy Keras's optimizer reaches ``merge_call`` from inside a
``cond`` branch; these helpers accumulate in replica context and update the variables
once, in cross-replica context (``keras_tf_gradient_accumulation``, ``keras_tf_clip_after_all_reduce``,
and ``tfdist.loops`` for a custom loop's accumulated gradients).

Example:
    >>> cross_replica_apply(optimizer, distribution, grads, variables)  # doctest: +SKIP
"""

from __future__ import annotations

from tfdist.core import upstream

__all__ = [
    "accumulate_in_replica_context",
    "consolidate_accumulators",
    "cross_replica_apply",
    "tf_var",
]


def tf_var(v):
    """The tf.Variable behind a Keras variable (strategies update tf.Variables)."""
    return v.value if isinstance(v, upstream.keras_backend_variable_class()) else v


def accumulate_in_replica_context(optimizer, grads, variables) -> None:
    """Steps 1-2 of the gradient-accumulation fix (see ``fix_gradient_accumulation``)."""
    import tensorflow as tf

    steps = optimizer.gradient_accumulation_steps
    context = tf.distribute.get_replica_context()
    accumulators = upstream.keras_optimizer_accumulators(optimizer, variables)
    # This replica's own gradient, dense (IndexedSlices too): nothing is reduced here.
    # Times the replica count: each copy of an accumulator then holds N x its replica's
    # share, so the MEAN over the copies is the window's sum so far, the value one device
    # holds, whatever N is (what ``consolidate_accumulators`` writes into every copy).
    replicas = context.num_replicas_in_sync
    local = [tf.convert_to_tensor(g) * replicas for g in grads]
    # Reading a mirrored accumulator in replica context reads this replica's copy: its
    # local sum of the window's earlier micro-steps.
    totals = [g + acc for g, acc in zip(local, accumulators, strict=True)]

    def merge_fn(distribution, local, totals):
        tf.cond(
            # The micro-step counter, as upstream: ``iterations`` counts updates only.
            (upstream.keras_optimizer_micro_steps(optimizer) + 1) % steps == 0,
            lambda: _cross_replica_update(optimizer, distribution, totals, variables, accumulators),
            lambda: _cross_replica_accumulate(distribution, local, accumulators),
        )

    context.merge_call(merge_fn, args=(local, totals))


def _cross_replica_update(optimizer, distribution, totals, variables, accumulators) -> None:
    """The update step: the window's one all-reduce, clip, the update, accumulators zeroed."""
    import tensorflow as tf

    reduced = distribution.extended.batch_reduce_to(
        tf.distribute.ReduceOp.MEAN,
        [(t, tf_var(v)) for t, v in zip(totals, variables, strict=True)],
    )
    clipped = _clipped_means(optimizer, distribution, reduced)
    cross_replica_apply(optimizer, distribution, clipped, variables)
    for acc in accumulators:
        distribution.extended.update(tf_var(acc), lambda a: a.assign(tf.zeros_like(a)), group=False)


def _clipped_means(optimizer, distribution, reduced) -> list:
    """``clip(sum / k)`` of the all-reduced window sums, on each local device's copy.

    ``clipnorm``/``global_clipnorm`` see the global mean gradient, as on one device. Each
    device clips its own (identical) copy, so no device waits for another's.
    """
    import tensorflow as tf

    steps = optimizer.gradient_accumulation_steps
    copies = [distribution.experimental_local_results(r) for r in reduced]
    local_replicas = len(copies[0])
    per_device = []
    for d in range(local_replicas):
        with tf.device(copies[0][d].device):
            per_device.append(
                upstream.keras_optimizer_clip(optimizer, [c[d] / steps for c in copies])
            )

    def value(i):
        # Replica ids run over the cluster; a worker's local replicas are consecutive.
        return lambda ctx: per_device[ctx.replica_id_in_sync_group % local_replicas][i]

    return [
        distribution.experimental_distribute_values_from_function(value(i))
        for i in range(len(reduced))
    ]


def cross_replica_apply(optimizer, distribution, grads, variables) -> None:
    """Weight decay, then the optimizer's update of every variable with ``grads``.

    What upstream's ``_apply_weight_decay`` and ``_backend_update_step`` do after their
    all-reduce, for gradients already all-reduced (and clipped): no second reduction.
    Shared by the gradient-accumulation and clipping fixes (``tfdist.compat.clipping``);
    called with the strategy ``merge_call`` hands over.

    Example:
        >>> cross_replica_apply(opt, strategy, clipped, variables)  # doctest: +SKIP
    """
    import tensorflow as tf

    if optimizer.weight_decay is not None:

        def weight_decay_fn(variable):
            if upstream.keras_optimizer_uses_weight_decay(optimizer, variable):
                lr = tf.cast(optimizer.learning_rate, variable.dtype)
                wd = tf.cast(optimizer.weight_decay, variable.dtype)
                variable.assign_sub(variable * wd * lr)

        for variable in variables:
            distribution.extended.update(tf_var(variable), weight_decay_fn, group=False)
    upstream.keras_optimizer_distributed_update(
        optimizer,
        distribution,
        list(zip(grads, [tf_var(v) for v in variables], strict=True)),
        optimizer.learning_rate,
    )


def consolidate_accumulators(optimizer) -> bool:
    """Gives every copy of each gradient accumulator the mean of the copies, mid-window.

    Under the fix, the copies of a mirrored accumulator differ between updates (each
    holds N x its replica's share), and a save reads one copy. Called before a save (the
    fix's ``save_own_variables``, tfdist's checkpoints), this makes every copy the mean:
    the window's sum so far, the value one device holds. A checkpoint written mid-window
    then resumes exactly, on any number of replicas. A collective: under
    MultiWorkerMirroredStrategy every worker must save (as the fixed Keras callbacks and
    tfdist's checkpoints do). Returns whether anything was done (not at a window
    boundary, where every copy is zero, nor on one replica).

    Example:
        >>> consolidate_accumulators(model.optimizer)  # doctest: +SKIP
        True
    """
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    accumulators = upstream.keras_optimizer_all_accumulators(optimizer) if steps else []
    if not steps or not accumulators:
        return False  # no accumulation, or an optimizer not built yet
    variables = [tf_var(a) for a in accumulators]
    strategy = getattr(variables[0], "distribute_strategy", None)  # tf.distribute's only
    if strategy is None or strategy.num_replicas_in_sync == 1:
        return False
    if int(upstream.keras_optimizer_micro_steps(optimizer).numpy()) % steps == 0:
        return False  # a window boundary: every copy is zero already
    import tensorflow as tf

    def copies_of(var):
        copies = strategy.experimental_local_results(var)

        def value(context):
            # Replica ids run over the cluster; a worker's local replicas are consecutive.
            copy = copies[context.replica_id_in_sync_group % len(copies)]
            with tf.device(copy.device):
                return tf.identity(copy)

        # Per replica, not mirrored: a MEAN of a mirrored value is returned unreduced.
        return strategy.experimental_distribute_values_from_function(value)

    @tf.function(autograph=False)
    def consolidate():
        pairs = [(copies_of(var), var) for var in variables]
        means = strategy.extended.batch_reduce_to(tf.distribute.ReduceOp.MEAN, pairs)
        for var, mean in zip(variables, means, strict=True):
            strategy.extended.update(var, lambda a, m: a.assign(m), args=(mean,), group=False)

    with strategy.scope():
        consolidate()
    return True


def _cross_replica_accumulate(distribution, local, accumulators) -> None:
    """The accumulate step: each replica adds its own gradient to its own accumulator copy.

    No communication: the copies of a mirrored accumulator hold different local sums
    until the update step all-reduces them.
    """
    for grad, acc in zip(local, accumulators, strict=True):
        distribution.extended.update(
            tf_var(acc), lambda a, g: a.assign_add(g), args=(grad,), group=False
        )
