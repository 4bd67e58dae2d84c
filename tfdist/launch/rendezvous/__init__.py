"""The rendezvous of an elastic job: which nodes train together, in what order, and when.

``tfdist launch --nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id JOB`` starts one
launcher per node. The launcher that can bind ``HOST:PORT`` hosts a small ``Store``
(torchrun's ``c10d`` choice: no service to install); every launcher is a ``Member``
that registers there and renews its lease every ``BEAT_S`` seconds.

The store forms *rounds*. A round is an ordered list of nodes: the survivors of the
last round first, in their old order (so the chief stays the chief while it lives),
then newcomers in the order they came. It forms when at least MIN nodes wait and no
node of the last round is still stopping its workers (or MAX nodes wait). A round ends
when a member stops renewing for ``lease`` seconds (its machine or launcher is gone),
leaves, restarts its own workers, or when a new node arrives and the round has fewer
than MAX nodes. The launchers see the end at their next renewal and stop their workers
at once; a node that arrives while the round is full waits as a spare.

The protocol is one JSON line each way per TCP connection; every request names the job,
and a request for another job is refused. The store listens on ``HOST`` only, so it is
as reachable as the workers' ports are.

With ``--rdzv-backend etcd`` no launcher hosts a store: each applies the same rules to
state kept in an etcd cluster. The package: ``store`` (the rules, ``Membership``, and
the c10d ``Store`` serving them), ``member`` (a node's side), ``etcd`` (the etcd backend).

``tfdist.launch.rendezvous.member``'s example runs a node against a store.

Example:
    >>> Round(1, ("10.0.0.1:2222", "10.0.0.2:2222"), index=1, nproc=1).size
    2
"""

# The package's names are its modules' public names (each module's __all__).
from tfdist.launch.rendezvous import member, store
from tfdist.launch.rendezvous.member import *  # noqa: F403
from tfdist.launch.rendezvous.store import *  # noqa: F403

__all__ = [*store.__all__, *member.__all__]
