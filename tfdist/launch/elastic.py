"""Elastic jobs: a node that is lost for good leaves the job, which goes on with the rest.

``tfdist launch --nnodes MIN:MAX --rdzv-endpoint HOST:PORT --rdzv-id JOB -n N script.py``
runs the same command on every node. The launchers meet in a rendezvous
(``tfdist.launch.rendezvous``) and start their workers for one *round*: the nodes that
are there, renumbered in order, each worker given the round's ``TF_CONFIG`` and JAX
coordinator. While the workers train, each launcher renews its lease every second.

When a node stops renewing (its machine or launcher is gone), the others stop their
workers at once (SIGTERM, SIGKILL after ``stop_grace``: they are stuck in a collective),
form the next round with who is left, and start again; the script resumes from its
newest checkpoint (``tfdist.make_or_restore``) on the new number of replicas with the
same global batch. A node started again with the same command joins at once: the round
ends with SIGTERM and ``grace``, so each worker saves its exact step first (tfdist's
preemption save, exit 75), and nothing is lost. Below MIN nodes the launchers wait up to
``join_timeout`` seconds, saying who is missing, then exit 1.

The store lives in the launcher of the node that owns the first endpoint. Give
``--rdzv-endpoint`` several endpoints (comma-separated, one per node that may host it)
and the store moves to the next one when its host is lost; with one endpoint, losing
its node ends the job (each launcher says so and exits 1). With ``--rdzv-backend etcd``
the nodes meet in an etcd cluster instead (``tfdist.launch.rendezvous.etcd``): no node
hosts anything, and any node may be lost.

Each re-form prints one line: what ended the round, the old and new number of nodes and
workers, the step the script resumed from, and the seconds from the end of the last round
to the first step of the new one. The line is also appended to ``LOG_DIR/elastic.jsonl``
when ``--log-dir`` is given.

Example:
    >>> ElasticOptions(min_nodes=2, max_nodes=3, endpoints=("127.0.0.1:29400",), job="j").max_nodes
    3
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import tempfile
import time
from typing import TextIO

from tfdist.core import validate
from tfdist.core.config import ELASTIC_EVENTS_ENV, RENDEZVOUS_ENV, ConfigError
from tfdist.launch.elastic_options import ElasticOptions, node_host, wanted
from tfdist.launch.network import JobNetwork
from tfdist.launch.options import LaunchOptions, check_options, is_loopback, split_host
from tfdist.launch.rendezvous import BEAT_S, Member, RendezvousError, Round, StoreUnreachable
from tfdist.launch.rendezvous_link import link_for
from tfdist.launch.supervise import exit_code, run_group
from tfdist.launch.workers import LauncherSignals

__all__ = ["ElasticOptions", "run_elastic", "wanted"]


logger = logging.getLogger("tfdist.launch")


def _free_ports(host: str, n: int) -> list[int]:
    """``n`` consecutive free ports on ``host`` (worker i listens on first + i)."""
    for _ in range(50):
        with socket.socket() as sock:
            sock.bind((host, 0))
            first = sock.getsockname()[1]
        if first + n > 65535:
            continue
        try:
            held = []
            for port in range(first, first + n):
                sock = socket.socket()
                held.append(sock)
                sock.bind((host, port))
            return list(range(first, first + n))
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise ConfigError(f"launch: found no {n} consecutive free ports on {host}. Received: nproc={n}")


def run_elastic(
    options: LaunchOptions,
    elastic: ElasticOptions,
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
) -> int:
    """Runs this node's part of an elastic job until it finishes; returns the exit code.

    ``options`` gives the workers (``nproc``, the script, ``max_restarts`` for failures
    of this node's own workers, grace periods, logs); its ``nnodes``, ``node_rank`` and
    ``hosts`` are set by each round.

    Example:
        >>> run_elastic(LaunchOptions(nproc=1, target="train.py"),
        ...             ElasticOptions(2, 3, ("10.0.0.1:29400",), "run42"))  # doctest: +SKIP
        0
    """
    check_options(options, "run_elastic")
    validate.instance(elastic, ElasticOptions, "elastic", "run_elastic", "an ElasticOptions")
    if not options.module and not os.path.isfile(options.target):
        raise ConfigError(
            f"launch: script {options.target!r} not found. Received: target="
            f"{options.target!r}. Pass a script path, or -m MODULE for a module."
        )
    remote = [e for e in elastic.endpoints if not is_loopback(split_host(e)[0])]
    if remote and not options.allow_remote:
        raise ConfigError(
            f"launch: rdzv_endpoint {remote} is not a loopback address. Received: "
            f"rdzv_endpoint={','.join(elastic.endpoints)!r}. The workers' gRPC ports have no "
            "authentication: only use a private network, then pass --allow-remote."
        )
    out, err = stdout or sys.stdout, stderr or sys.stderr
    host = node_host(elastic)
    ports = (
        _free_ports(host, options.nproc)
        if options.port is None
        else [options.port + i for i in range(options.nproc)]
    )
    with LauncherSignals() as signals, tempfile.TemporaryDirectory(prefix="tfdist-elastic-") as tmp:
        node = _Node(options, elastic, host, ports, signals, out, err, os.path.join(tmp, "events"))
        try:
            return node.run()
        except RendezvousError as error:
            logger.error("elastic job: %s", error)
            return 1
        finally:
            node.rendezvous.close(linger=3 * BEAT_S if node.finished else 0)


class _Node:
    """The loop of one node: meet, run a round, see how it ended, meet again."""

    def __init__(self, options, elastic, host, ports, signals, out, err, events):
        self.options, self.elastic, self.signals = options, elastic, signals
        self.out, self.err, self.events = out, err, events
        self.rendezvous = link_for(elastic, host, ports, self.say)
        self.rendezvous.repick = self._ports  # two launchers on one host, the same ports
        self.name = f"{host}:{ports[0]}"
        self.finished = False
        self.starts = 0  # group starts on this node (TFDIST_RESTART)
        self.failures = 0

    def say(self, line: str) -> None:
        logger.warning("%s", line)

    def run(self) -> int:
        member = self.rendezvous.connect(self.elastic.join_timeout)
        member.start_beating()
        try:
            return self._rounds(member)
        except BaseException:
            self.rendezvous.member.leave()  # the others re-form at once, not after a lease
            raise
        finally:
            self.rendezvous.member.stop_beating()

    def _rounds(self, member: Member) -> int:
        last, previous = 0, None
        while True:
            if self.signals.count:
                member.leave()
                return 128 + (self.signals.received or 15)
            try:
                round_ = member.wait_round(last, timeout=self.elastic.join_timeout, say=self.say)
            except StoreUnreachable:
                member, last = self._move_on(member), 0
                continue
            if round_ is None:
                self.finished = True
                self.say("elastic job: the other nodes finished the job")
                return 0
            outcome = self._run_round(member, round_, previous)
            previous, last = round_, round_.number
            kind = outcome.kind
            if kind in ("failed", "restart") and self._ended_elsewhere(member, round_):
                kind = "reform"  # a lost peer broke our workers' collectives
            if member.store_lost:
                kind = "store-lost"
            if kind == "ok":
                return self._finish(member)
            if kind == "signalled":
                member.leave()
                return exit_code(outcome, self.signals.received)
            if kind == "store-lost":
                member, last = self._move_on(member), 0
                continue
            if kind in ("failed", "restart"):  # this node's own workers ended
                if self.failures >= self.options.max_restarts:
                    member.leave()
                    return exit_code(outcome)
                self.failures += 1
            try:
                member.join(self._ports())
            except StoreUnreachable:
                member, last = self._move_on(member), 0

    def _ports(self) -> list[int] | None:
        """Fresh free worker ports for the next round (None: ``--port`` fixes them)."""
        if self.options.port is not None:
            return None
        self.rendezvous.ports = _free_ports(self.rendezvous.host, self.options.nproc)
        return self.rendezvous.ports

    def _move_on(self, member: Member) -> Member:
        member.stop_beating()
        self._ports()
        member = self.rendezvous.move_on()
        member.start_beating()
        return member

    def _ended_elsewhere(self, member: Member, round_: Round) -> bool:
        """After our workers failed: did the round end for another node's reason (seen
        within a lease)? A peer lost mid-collective often fails the workers first."""
        deadline = time.monotonic() + self.elastic.lease + 2 * BEAT_S
        while time.monotonic() < deadline:
            if member.ended(round_.number) is not None:
                return True
            time.sleep(0.1)
        return False

    def _round_options(self, round_: Round) -> LaunchOptions:
        return dataclasses.replace(
            self.options,
            nnodes=round_.size,
            node_rank=round_.index,
            hosts=round_.nodes,
            port=None,
            allow_remote=self.options.allow_remote,
        )

    def _run_round(self, member: Member, round_: Round, previous: Round | None):
        options = self._round_options(round_)
        started = time.time()
        told = {"done": False}

        def ended():
            if not told["done"]:
                told["done"] = self._tell_reform(round_, previous, started)
            why = member.ended(round_.number)
            if why is None:
                return None
            patient = "joined" in (member.view.get("why") or "") and "error" not in member.view
            kind = "store-lost" if member.store_lost else "reform"
            return kind, why, patient

        os.environ[ELASTIC_EVENTS_ENV] = self.events  # the workers inherit both
        os.environ[RENDEZVOUS_ENV] = (
            f"{self.elastic.backend} store at {member.endpoint}, job {self.elastic.job!r}, round "
            f"{round_.number} of {round_.size} node(s), this node {round_.index}"
        )
        network = JobNetwork(options)
        try:
            outcome = run_group(
                options, self.starts, self.signals, self.out, self.err, network, ended=ended
            )
        finally:
            network.close()
            os.environ.pop(ELASTIC_EVENTS_ENV, None)
            os.environ.pop(RENDEZVOUS_ENV, None)
        self.starts += 1
        return outcome

    def _tell_reform(self, round_: Round, previous: Round | None, started: float) -> bool:
        """Prints the round's line once its first step is known; True once said."""
        first = _first_step(self.events, self.starts)
        if first is None:
            return False
        since = round_.ended_at or started
        workers = round_.size * round_.nproc
        if previous is None and not round_.why:
            line = f"elastic job: round {round_.number} started on {round_.size} node(s), {workers} worker(s)"
        else:
            old = (
                f"{previous.size} node(s) ({previous.size * previous.nproc} workers)"
                if previous
                else "?"
            )
            line = (
                f"elastic job: re-formed ({round_.why or 'the job re-formed'}): {old} -> "
                f"{round_.size} node(s) ({workers} workers); resumed from step "
                f"{first.get('resumed_step')}; {first['time'] - since:.1f} s from the end of "
                f"round {round_.number - 1} to the first step of round {round_.number}"
            )
        self.say(line)
        if self.options.log_dir:
            record = {
                "round": round_.number,
                "nodes": list(round_.nodes),
                "why": round_.why,
                "resumed_step": first.get("resumed_step"),
                "seconds_to_first_step": round(first["time"] - since, 3),
                "line": line,
            }
            os.makedirs(self.options.log_dir, exist_ok=True)
            with open(
                os.path.join(self.options.log_dir, "elastic.jsonl"), "a", encoding="utf-8"
            ) as f:
                f.write(json.dumps(record) + "\n")
        return True

    def _finish(self, member: Member) -> int:
        """Our workers finished: say so, then wait (bounded) until every member has."""
        member.done()
        deadline = time.monotonic() + self.options.finish_timeout
        while time.monotonic() < deadline:
            try:
                if member.ask("beat").get("finished"):
                    break
            except RendezvousError:
                break  # the store's host finished and left
            time.sleep(0.5)
        self.finished = True
        return 0


def _first_step(path: str, start: int) -> dict | None:
    """The first-step record the workers of start ``start`` wrote (None: not yet)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("start") == start:
            return record
    return None
