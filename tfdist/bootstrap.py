"""Runs a script as ``__main__`` in a process set up by tfdist: what ``tfdist launch`` runs.

``python -m tfdist.bootstrap train.py ARGS`` installs tfdist's start-up hooks
(``tfdist.startup``: fixes applied when TensorFlow and Keras are imported, logical CPUs
and the multi-worker strategy set up before TensorFlow's first op), then runs the script
exactly as ``python train.py ARGS`` would: same ``sys.argv``, same ``sys.path[0]``, its
exit status is the process's. So scripts that never import tfdist, and build
``tf.distribute.MultiWorkerMirroredStrategy()`` themselves, get the same set-up.

Example:
    $ python -m tfdist.bootstrap train.py --epochs 3
    $ python -m tfdist.bootstrap -m mypackage.train --epochs 3
"""

from __future__ import annotations

import os
import re
import runpy
import sys
from collections.abc import Sequence

from tfdist import startup, unscoped
from tfdist.core import config, exit_hold

__all__ = ["main"]

_USAGE = (
    "usage: python -m tfdist.bootstrap SCRIPT [ARGS...]\n"
    "       python -m tfdist.bootstrap -m MODULE [ARGS...]\n"
    "Sets the process up as tfdist does (fixes, TFDIST_CPU_DEVICES, multi-worker), then runs "
    "SCRIPT or MODULE as __main__."
)


def main(argv: Sequence[str] | None = None) -> None:
    """Installs tfdist's start-up hooks, then runs a script or module as ``__main__``.

    Args:
        argv: ``[SCRIPT, *ARGS]`` or ``["-m", MODULE, *ARGS]``; defaults to ``sys.argv[1:]``.

    Example:
        >>> main(["train.py", "--epochs", "3"])  # doctest: +SKIP
    """
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        print(_USAGE, file=sys.stderr)
        raise SystemExit(0 if args and args[0] in ("-h", "--help") else 2)
    module = args[0] == "-m"
    target = args[1] if module else args[0]
    if not module and not os.path.isfile(target):
        print(f"python -m tfdist.bootstrap: cannot open file {target!r}", file=sys.stderr)
        raise SystemExit(2)
    startup.install()
    unscoped.enable()
    try:
        _run(module, target, args)
    except SystemExit as stop:
        exit_hold.script_ended(clean=stop.code in (None, 0, config.RESTART_EXIT_CODE))
        raise
    except BaseException as err:
        exit_hold.script_ended(clean=False)
        if isinstance(err, Exception) and _is_loop_outside_the_replicas(err):
            print(_LOOP_HINT, file=sys.stderr, flush=True)  # then upstream's traceback
            raise
        if not isinstance(err, Exception) or config.debug() or not _is_lost_peer(err):
            raise
        # A peer died or never came: the launcher names it; one line is enough here. A
        # peer that simply finished while this worker was in a collective it never joined
        # (a chief-only predict) looks the same to TensorFlow ("tasks have crashed").
        print(
            f"tfdist: {type(err).__name__}: {_summary(err)} ({_LOST_PEER_HINT}; "
            "TFDIST_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        raise SystemExit(1) from None


# What a worker raises when a peer is gone or never started (TensorFlow's status codes,
# or the same codes in jax's runtime errors); anything else keeps its traceback.
_LOST_PEER_TF = {"UnavailableError", "DeadlineExceededError", "AbortedError", "CancelledError"}
_LOST_PEER_JAX = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "heartbeat", "coordination service")


_LOST_PEER_HINT = (
    "that worker died, stopped answering or never started; or it finished while this one "
    "was in a call it never made, such as fit, evaluate, predict, save or load on the "
    "chief only: every worker must make the same calls"
)


_LOOP_HINT = (
    "tfdist: this script steps a model outside the strategy's replicas (a custom training "
    "loop without strategy.run), and its models were built on the job's strategy because "
    f"they were built outside any scope ({config.UNSCOPED_MODELS_ENV}=job). Run the step "
    "with strategy.run (docs/custom_loops.md), or launch with --unscoped-models local "
    "(each process trains its own copy, as upstream)."
)


def _is_loop_outside_the_replicas(err: BaseException) -> bool:
    """TensorFlow's refusal to step a mirrored variable outside a replica, in a process
    whose unscoped models were given the job's strategy (``tfdist.unscoped``)."""
    from tfdist.core import process

    text = "is not available outside the replica context"
    return process.state().unscoped_strategy is not None and text in str(err)


def _is_lost_peer(err: BaseException) -> bool:
    kind = type(err)
    if kind.__module__.startswith("tensorflow") and kind.__name__ in _LOST_PEER_TF:
        return True
    if kind.__module__.startswith(("jax", "jaxlib")):
        return any(word in str(err) for word in _LOST_PEER_JAX)
    return False


def _summary(err: BaseException) -> str:
    """The line of the error that names the lost peer (TensorFlow puts it deep inside)."""
    # "{{function_node ...}}" is TensorFlow's name for the graph function: noise here.
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(err))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for word in ("unhealthy", "/job:", "task", "heartbeat"):
        for i, line in enumerate(lines):
            if word in line:
                if line.endswith(":") and i + 1 < len(lines):  # the task list follows
                    line = f"{line} {lines[i + 1]}"
                return line[:400]
    return lines[0][:400] if lines else "(no message)"


def _run(module: bool, target: str, args: list[str]) -> None:
    # sys.path[0] is the current directory under `python -m tfdist.bootstrap`, as it is for
    # `python -m MODULE`; `python SCRIPT` puts the script's directory there instead.
    if module:
        sys.argv = [target, *args[2:]]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args[1:]]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main()
