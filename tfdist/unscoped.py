"""Models a script builds outside any scope train on the job's strategy or distribution.

Keras's own examples never open a strategy scope. Run as written on N devices or N workers,
such a script trains on one replica per process: TensorFlow's default strategy, or no
``keras.distribution`` on JAX. Each worker then trains its own copy on all the data.

Under ``tfdist launch`` and ``python -m tfdist.bootstrap`` (``TFDIST_UNSCOPED_MODELS=job``,
the default), the first Keras layer or optimizer the script builds outside any scope
makes the job's strategy the process default: ``tf.distribute.experimental_set_strategy``
on TensorFlow, ``keras.distribution.set_distribution`` on JAX. Every model built after that
trains on every replica of every worker, as if the whole script ran in ``tfdist.scope()``.
The script's ``batch_size`` is then the global batch, split over the replicas. One line on
the chief says so. ``TFDIST_UNSCOPED_MODELS=local`` (``tfdist launch --unscoped-models
local``) keeps upstream's behaviour: one replica per process.

A script that opens a strategy scope of its own keeps it. If it does so after an unscoped
model was built, the process default steps aside (TensorFlow refuses two strategies at
once), one line names the script's strategy, and later unscoped models train on one
replica per process, as upstream.

Example:
    >>> from tfdist import unscoped
    >>> unscoped.enable()      # python -m tfdist.bootstrap does it before the script runs
"""

from __future__ import annotations

import inspect
import logging
import sys

from tfdist import backends
from tfdist.core import config, fix_registry, process, roles, upstream

__all__ = ["HOOK", "enable", "enabled", "on_keras_import"]

logger = logging.getLogger(__name__)

NAME = "tfdist_unscoped_models"


def enable() -> None:
    """Makes models built outside any scope train on the job (bootstrap calls it)."""
    st = process.state()
    st.unscoped_models = config.unscoped_models()
    if "keras" in sys.modules and hasattr(sys.modules["keras"], "__spec__"):
        on_keras_import(sys.modules["keras"])


def enabled() -> bool:
    """Whether unscoped models train on the job in this process."""
    return process.state().unscoped_models == "job"


def on_keras_import(_keras) -> None:
    """Installs the hook once Keras is imported, if ``enable()`` asked for it."""
    if enabled():
        reason = fix_registry.apply_fix(HOOK)
        if reason is not None:
            logger.warning(
                "tfdist: models built outside a scope cannot be given the job's strategy "
                "(%s): they train on one replica per process. Open tfdist.scope() around "
                "the model.",
                reason,
            )


# --------------------------------------------------------------------------- the hook


def _adopt_first(original):
    def __init__(self, *args, **kwargs):
        st = process.state()
        if st.unscoped_default is None:
            _adopt()
        elif st.unscoped_strategy is not None:
            _readopt(st.unscoped_strategy)
        return original(self, *args, **kwargs)

    # Keras reads a layer's constructor arguments from ``cls.__init__`` (its automatic
    # get_config, with inspect.getfullargspec, which ignores __wrapped__): the wrapper
    # must show the original's signature, or saving a layer without __init__ fails.
    __init__.__signature__ = inspect.signature(original)
    return __init__


def _adopt() -> None:
    """Makes the job's strategy (distribution) the process default, once, if it has >1 replica."""
    if backends.name() == "jax":
        _adopt_jax()
    else:
        _adopt_tensorflow()


def _readopt(default) -> None:
    """Sets the adopted default again where ``keras.backend.clear_session()`` dropped it
    (it resets TensorFlow's default graph, which holds the process default strategy, and
    Keras's global state, which holds the JAX distribution)."""
    if backends.name() == "jax":
        import keras

        if keras.distribution.distribution() is None:
            keras.distribution.set_distribution(default)
        return
    import tensorflow as tf

    if not tf.distribute.has_strategy() and tf.executing_eagerly():
        tf.distribute.experimental_set_strategy(default)


def _adopt_tensorflow() -> None:
    import tensorflow as tf

    from tfdist.backends import tensorflow as tf_backend

    if tf.distribute.has_strategy() or not tf.executing_eagerly():
        return  # in the script's own scope (or a trace): decide at the next unscoped model
    st = process.state()
    plan = tf_backend.current_plan() or tf_backend.plan()
    if plan.num_replicas <= 1:
        st.unscoped_default = "one replica: nothing to distribute"
        return
    strategy = tf_backend.strategy()
    tf.distribute.experimental_set_strategy(strategy)
    st.unscoped_strategy = strategy
    kind = "MultiWorkerMirroredStrategy" if plan.kind == "multi_worker" else "MirroredStrategy"
    st.unscoped_default = _announce(kind, strategy.num_replicas_in_sync)


def _adopt_jax() -> None:
    import jax
    import keras

    st = process.state()
    if keras.distribution.distribution() is not None:
        return  # the script's own distribution, or tfdist.scope(): decide later
    if jax.device_count() <= 1:
        st.unscoped_default = "one replica: nothing to distribute"
        return
    from tfdist.backends import jax as jax_backend

    chosen = jax_backend.distribution()
    with st.lock:
        st.distribution = (type(chosen).__name__, chosen)
    keras.distribution.set_distribution(chosen)
    st.unscoped_strategy = chosen
    st.unscoped_default = _announce(type(chosen).__name__, jax.device_count())


def _announce(kind: str, replicas: int) -> str:
    workers = roles.from_env().count
    where = f"{replicas} replicas on {workers} worker{'s' * (workers > 1)}"
    text = f"the job's {kind} ({where})"
    _tell(
        f"tfdist: models this script builds outside any scope train on {text}; its "
        f"batch_size is the global batch, split over the replicas "
        f"({config.UNSCOPED_MODELS_ENV}=local: one replica per process, as upstream)"
    )
    return text


def _tell(line: str) -> None:
    """One line on stderr, from the chief only."""
    if roles.is_chief():
        print(line, file=sys.stderr, flush=True)


def _step_aside_for(extended) -> None:
    """A script's own strategy is about to run: the process default steps aside, once."""
    import tensorflow as tf

    default = process.state().unscoped_strategy
    if default is None or extended is default.extended:
        return
    if upstream.tf_process_default_scope() is None or tf.distribute.get_strategy() is not default:
        return
    tf.distribute.experimental_set_strategy(None)
    process.state().unscoped_strategy = None
    process.state().unscoped_default = "stepped aside for the script's own strategy"
    _tell(
        "tfdist: this script opens a tf.distribute strategy of its own: its models train "
        "on it, and models it builds outside any scope from now on train on one replica "
        "per process, as upstream"
    )


def _step_aside_in_check(original):
    def require_cross_replica_or_default_context_extended(extended, *args, **kwargs):
        _step_aside_for(extended)
        return original(extended, *args, **kwargs)

    return require_cross_replica_or_default_context_extended


def _step_aside_in_scope(original):
    def scope(self):
        _step_aside_for(self.extended)
        return original(self)

    return scope


def _install() -> None:
    fix_registry.patch(upstream.keras_layer_class(), "__init__", NAME, _adopt_first)
    if backends.name() != "tensorflow":
        return
    fix_registry.patch(upstream.keras_tf_optimizer_class(), "__init__", NAME, _adopt_first)
    lib = upstream.tf_distribute_lib()
    fix_registry.patch(
        lib, "_require_cross_replica_or_default_context_extended", NAME, _step_aside_in_check
    )
    fix_registry.patch(lib.StrategyBase, "scope", NAME, _step_aside_in_scope)


_TF_TARGETS = (
    "keras.src.backend.tensorflow.optimizer:TFOptimizer.__init__",
    "tensorflow.python.distribute.distribute_lib:"
    "_require_cross_replica_or_default_context_extended",
    "tensorflow.python.distribute.distribute_lib:StrategyBase.scope",
)

# A hook, not a fix: it repairs nothing upstream, it makes the job the default. Applied
# through the same guard as every patch (a changed target: it steps aside with a warning),
# never listed in tfdist.compat.FIXES, and no exclusion removes it (TFDIST_UNSCOPED_MODELS
# does).
HOOK = fix_registry.Patch(
    NAME,
    _install,
    purpose="models a script builds outside any scope train on the job's strategy or distribution",
    targets=fix_registry.targets("keras.src.layers.layer:Layer.__init__", *_TF_TARGETS),
)
