"""The custom-loop side of ``tfdist check``'s hook: a script's own loop stopped after N steps.

One watcher per backend, chosen by ``tfdist.check.hook``: ``tensorflow`` counts the
batches a loop draws from ``tf.distribute``'s distributed datasets; ``jax`` counts the
calls of the loop's ``jax.jit``-compiled training step.
"""
