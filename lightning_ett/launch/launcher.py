"""``lightning run``: start and restart a job with PyTorch's elastic launcher, and own its clock.

This is a thin layer over :mod:`torch.distributed.run` (torchrun): rendezvous, worker
processes, restarts and signal forwarding are torchrun's. What the layer adds:

* **Job identity.** The run directory, job id and job start (this launcher's own process
  start) go into the environment, so every rank's ETT ledger counts from launch, across
  every attempt, to the end.
* **Attempts numbered alike on every node.** Each start of the worker group is one attempt.
  ``TORCHELASTIC_RESTART_COUNT`` cannot number them: a node whose workers were healthy
  restarts them without counting a restart. Every node starts its workers once per
  rendezvous round, so counting starts agrees across nodes.
* **Restarts that work.** By default torchrun (2.13) hands every attempt the agent's one TCP
  store, where a restarted gloo/NCCL group reads the dead attempt's addresses and fails or
  hangs. ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives each attempt a fresh store on a free
  port instead.
* **Why an attempt ended.** Each failure (rank, exit code or signal, last exception line of
  its stderr) goes to ``RUN_DIR/ledger/launcher/``; worker logs are kept per attempt under
  ``RUN_DIR/worker_logs/``.
* **Restarts without re-imports.** Workers are forked from one pre-imported server per node
  (:mod:`lightning_ett.launch.worker`), unless ``preload=False`` (``--no-preload``). A SIGTERM
  stops them at once (torch's agent would leave finished forked workers waiting 30 s).
* **One W&B service for the job** (:mod:`lightning_ett.launch.wandb_service`) when the script
  mentions W&B: a killed rank's records are still written, and restarts connect instead of
  starting one.
* **Hangs end.** A rank alive but silent past its phase's timeout gets its stacks dumped and
  named, and the group is stopped and restarted (:mod:`lightning_ett.launch.hang_response`).
* **The report** (``lightning-ett report``) is printed at the end.

torch exposes no parameter for the agent class, so :func:`launch` swaps
``LocalElasticAgent`` in :mod:`torch.distributed.launcher.api` for a subclass for the
duration of the launch, in this (the launcher's) process only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from lightning_ett.durable.errors import follows_another_rank
from lightning_ett.durable.ownership import (
    DirectoryInUseError,
    OwnerLock,
    declare_gone,
    read_owner,
    run_dir_owner_file,
    withdraw_gone,
)
from lightning_ett.instrument.environment import (
    ENV_ATTEMPT,
    ENV_ATTEMPT_START,
    ENV_HANG_WATCH,
    ENV_JOB_ID,
    ENV_JOB_START,
    ENV_LAUNCHER,
    ENV_LAUNCHER_PID,
    ENV_RUN_DIR,
    process_start_time,
    write_job_file,
)
from lightning_ett.instrument.ledger import (
    LedgerWriter,
    launcher_ledger_path,
    read_launcher_records,
    read_ledger,
    recorded_attempts,
)
from lightning_ett.instrument.timeline import CHECKPOINT_FACT, Phase
from lightning_ett.launch.hang_response import HangOptions, HangVerdict, HangWatch, stop_processes
from lightning_ett.launch.peers import NodeLostVerdict, PeerEvent, PeerWatch
from lightning_ett.launch.progress_line import DEFAULT_EVERY_S as DEFAULT_PROGRESS_EVERY_S
from lightning_ett.launch.progress_line import ProgressLine
from lightning_ett.launch.wandb_service import WandbService
from lightning_ett.launch.worker import EXIT_NOT_RETRYABLE
from lightning_ett.lifecycle.faults import FAULT_INJECTION
from lightning_ett.lifecycle.sweeper import Sweeper, kill_process_groups, sweep_attempt

WORKER_LOGS = "worker_logs"
WAITING = "; waiting for it, or a launcher replacing it, to rejoin the rendezvous (torch's join timeout, 600 s)"
DEFAULT_MAX_RESTARTS = 3


@dataclass(frozen=True)
class LaunchOptions:
    """A validated ``lightning run`` command line (see :func:`lightning_ett.launch.cli.build_parser`)."""

    script: str
    script_args: tuple[str, ...]
    devices: int
    num_nodes: int = 1
    node_rank: int = 0
    main_address: str = "127.0.0.1"
    main_port: int | None = None
    local_addr: str | None = None  # what this node advertises to the others (None: its hostname, as torchrun)
    max_restarts: int = DEFAULT_MAX_RESTARTS
    preload: bool = True
    run_dir: Path = field(default_factory=lambda: Path("ett_runs"))
    job_id: str = ""
    monitor_interval: float = 0.1
    hang: HangOptions = field(default_factory=HangOptions)
    progress_every_s: float = DEFAULT_PROGRESS_EVERY_S  # 0: no progress line


def next_attempt(run_dir: Path) -> int:
    """The first attempt number of a new launch into ``run_dir`` (a relaunch continues the job)."""
    numbers = recorded_attempts(run_dir)
    for record in read_launcher_records(run_dir):
        if record.get("kind") == "attempt":
            numbers.append(int(record["attempt"]))
    return max(numbers, default=-1) + 1


def failure_reason(exitcode: int, stderr_file: str | None) -> str:
    """A one-line reason: the signal that killed the rank or its last exception line."""
    raw = [_LOG_PREFIX.sub("", line, count=1) for line in _tail(stderr_file)]
    tail = [line.strip() for line in raw]
    if exitcode < 0:
        try:
            reason = f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            reason = f"killed by signal {-exitcode}"
        injected = [line for line in tail if line.startswith(FAULT_INJECTION)]
        return f"{reason} ({injected[-1]})" if injected else reason
    for line in reversed(tail):
        if _EXCEPTION_LINE.match(line):
            return f"exit code {exitcode}: {line[:500]}"
    usage = _usage_error(raw) if exitcode in (2, EXIT_NOT_RETRYABLE) else None  # how a parser's error exits
    if usage is not None:
        return f"exit code {exitcode}: {usage[:500]}"
    last = next((line for line in reversed(tail) if line), None)  # e.g. sys.exit("message")
    return f"exit code {exitcode}: {last[:500]}" if last else f"exit code {exitcode}"


def _usage_error(raw: list[str]) -> str | None:
    """An argument parser's error (argparse's ``prog: error: ...``, LightningCLI's jsonargparse ``error: ...``) on one
    line, if the log ends with it: it, and the nested lines that name the key and the value at fault, up to the
    first value given. ``raw``: the log's lines, indentation kept (only indented lines may follow the error's).

    Why not the last line: jsonargparse ends with the whole list it was given (``Given value: [Namespace(...)]``),
    and names the bad key and value (``Parser key "every_n_train_steps"``, ``Given value: autoo``) lines above.
    """
    for i in range(len(raw) - 1, -1, -1):
        if _USAGE_ERROR.match(raw[i]):
            details: list[str] = []
            for line in (line.strip().lstrip("- ") for line in raw[i + 1:]):
                after_class_path = bool(details) and details[-1].startswith("Problem with given class_path")
                if after_class_path or _USAGE_DETAIL.match(line):  # (the line after a class path's: its reason)
                    details.append(line)
                    if (after_class_path and not line.endswith(":")) or line.startswith("Given value:") or (
                            "Got value:" in line or line.endswith("is not accepted") or len(details) == 4):
                        break
            return " ".join([raw[i].strip(), *details])
        if raw[i].strip() and not raw[i][:1].isspace():
            return None  # a line of its own after any error block: the log does not end with a parser's error
    return None


_LOG_PREFIX = re.compile(r"^\[[^\]]*\]:")  # torchrun's "[rank1]:" on teed lines
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b")
_USAGE_ERROR = re.compile(r"^(?:\S+: )?error: ")
_USAGE_DETAIL = re.compile(r"^(Problem with given class_path|Parser key|Option '|Given value:|Expected .* Got value:|"
                           r"Unrecognized arguments)")


def _mtime(path: str | None) -> float:
    try:
        return os.path.getmtime(path) if path else float("inf")
    except OSError:
        return float("inf")


def _tail(path: str | None, max_bytes: int = 64 * 1024) -> list[str]:
    if not path or not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        f.seek(max(os.path.getsize(path) - max_bytes, 0))
        return f.read().decode(errors="replace").splitlines()


class LaunchRecorder:
    """Numbers the attempts of this launch and writes the launcher's ledger for this node."""

    def __init__(self, opts: LaunchOptions, job_start: float, wandb_service: WandbService | None = None,
                 token: str | None = None) -> None:
        self.opts = opts
        self.wandb_service = wandb_service
        self.first_attempt = next_attempt(opts.run_dir)
        self.attempt = self.first_attempt - 1
        self.last_failure: str | None = None
        self.not_retryable = False  # the last failure will fail the same way on every attempt
        self.token = token
        if opts.hang.enabled:
            from lightning_ett.launch.worker import MENTIONS_MONITOR, mentions

            self.watch: HangWatch | None = HangWatch(
                opts.run_dir, opts.hang, num_nodes=opts.num_nodes, token=token,
                expects_ledgers=mentions(MENTIONS_MONITOR, opts.script, opts.script_args))
        else:
            self.watch = None
        self.hang: HangVerdict | NodeLostVerdict | None = None  # set by a watch: the failure that follows is this
        self.progress = (ProgressLine(opts.run_dir, opts.progress_every_s)
                         if opts.progress_every_s > 0 and opts.node_rank == 0 else None)
        self.writer = LedgerWriter(launcher_ledger_path(opts.run_dir, opts.node_rank))
        self.address = opts.local_addr or _own_address(opts.main_address)  # this node's, as the report names it
        self._write_lock = threading.Lock()  # the peer watch's thread writes too
        self.peers: PeerWatch | None = None  # set by launch() in a multi-node job
        self._between_attempts = True  # no worker group running: after a failure, before the next start
        self._worker_pids: list[int] = []
        self._worker_ranks: list[int] = []
        self._append({
            "kind": "launch", "time": time.time(), "job_start": job_start, "node_rank": opts.node_rank,
            "num_nodes": opts.num_nodes, "devices": opts.devices, "max_restarts": opts.max_restarts,
            "first_attempt": self.first_attempt, "host": socket.gethostname(), "pid": os.getpid(),
            "address": self.address,
            "argv": [opts.script, *opts.script_args],
        })

    def _append(self, record: dict[str, Any]) -> None:
        with self._write_lock:
            self.writer.append(record)

    def peer_event(self, event: PeerEvent) -> None:
        """From the peer watch's thread: a node lost or back, said once on the console and in the ledger."""
        self._declare(event)  # first: a scheduler may start a replacement as soon as it reads the line below
        waiting = event.kind == "node_lost" and self._between_attempts
        print(f"lightning run: {event.line()}" + (WAITING if waiting else ""), file=sys.stderr, flush=True)
        self._append(event.record(self.attempt))

    def _declare(self, event: PeerEvent) -> None:
        """A lost node's launcher's lock on its part of the run directory looks alive for a minute more: declared
        gone, a replacement on another host takes it over once it is 30 s silent (only that launcher's lock, and
        only while it stays silent); a node back takes the declaration back."""
        lock = run_dir_owner_file(event.node_rank)
        try:
            if event.kind == "node_lost" and event.owner_token:
                if declare_gone(self.opts.run_dir, lock, event.owner_token, event.line()) is None \
                        and (holder := read_owner(self.opts.run_dir / lock)) is not None:
                    print(f"lightning run: warning: node {event.node_rank}'s part of {str(self.opts.run_dir)!r} is held by "
                          f"{holder.describe()}, not by the launcher that stopped responding; it is left alone.",
                          file=sys.stderr, flush=True)
            elif event.kind == "node_back":
                withdraw_gone(self.opts.run_dir, lock)
        except OSError as err:
            effect = ("a replacement on another host is refused until that lock is 60 s stale"
                      if event.kind == "node_lost" else "a replacement started while it stays silent may take it over")
            print(f"lightning run: warning: could not record in {str(self.opts.run_dir)!r} that node {event.node_rank} "
                  f"{'stopped responding' if event.kind == 'node_lost' else 'is back'} ({err}): {effect}.",
                  file=sys.stderr, flush=True)

    def stopped_by_node0(self, attempt: int, reason: str) -> None:
        """From the peer watch's thread (nodes other than 0): node 0 stopped ``attempt`` for a lost node. This node's
        ranks of it may wait on peers that are gone (a partition swallowed the connection resets): stop them too."""
        if attempt != self.attempt or self.hang is not None or self._between_attempts:
            return
        now = time.time()
        self.hang = NodeLostVerdict(attempt, -1, "", now, now, sorted(self._worker_ranks), told=reason, stopping=now)
        stopped = stop_processes(list(self._worker_pids), self.opts.hang.grace_s)
        self.hang = replace(self.hang, stopped=stopped)
        print(f"lightning run: attempt {attempt} {self.hang.reason}", file=sys.stderr, flush=True)

    def starting_workers(self) -> dict[str, str]:
        """Called before each start of the worker group: the environment of this attempt's workers."""
        self.attempt += 1
        now = time.time()
        self._between_attempts = False
        if self.peers is not None:
            self.peers.attempt = self.attempt
        env = {ENV_ATTEMPT: str(self.attempt), ENV_ATTEMPT_START: repr(now)}
        if self.wandb_service is not None:
            env.update(self.wandb_service.worker_env())
        os.environ.update(env)  # subprocess workers inherit it; forked ones get `env` as an argument
        self._append({"kind": "attempt", "attempt": self.attempt, "time": now, "node_rank": self.opts.node_rank})
        self.hang = None
        if self.watch is not None:
            self.watch.attempt_started(self.attempt, now)
        if self.progress is not None:
            self.progress.attempt_started(self.attempt, now)
        return env

    def watch_workers(self, workers: dict[int, tuple[int, str | None]]) -> None:
        """One look at this node's ranks (``global rank -> (pid, stderr log)``); a hang stops them."""
        if self.progress is not None:
            try:
                if (line := self.progress.poll()) is not None:
                    print(line, flush=True)
            except Exception as err:  # noqa: BLE001 - a closed stdout, an odd ledger: the line goes, the job stays
                self.progress = None
                with contextlib.suppress(Exception):
                    print(f"lightning run: progress line off ({type(err).__name__}: {err})", file=sys.stderr, flush=True)
        self._worker_pids, self._worker_ranks = [pid for pid, _ in workers.values()], sorted(workers)
        if self.watch is not None and self.hang is None:
            self.hang = self.watch.poll(workers)
            while self.watch.cleared:  # suspicions a working rank cleared: in the ledger, not on the console
                self._append(self.watch.cleared.pop(0))
            if isinstance(self.hang, NodeLostVerdict):  # node 0: the other nodes stop this attempt too
                print(f"lightning run: attempt {self.attempt} stopped: {self.hang.reason}", file=sys.stderr, flush=True)
                if self.peers is not None:
                    self.peers.announce_stop(self.attempt, self.hang.reason)
            elif self.hang is not None:  # one line now; the stacks are in RUN_DIR/stacks/, the verdict in the report
                print(f"lightning run: attempt {self.attempt} {self.hang.reason}; its group was stopped "
                      f"(evidence: {self.hang.culprit.evidence})", file=sys.stderr, flush=True)

    def workers_failed(self, failures: dict[int, Any], stderr_files: dict[int, str],
                       suspects: set[int] | None = None) -> None:
        """Record each failed rank, the root cause first.

        torchelastic reports every rank of a failed group at once, after it stopped the
        survivors. Suspects are the ranks that had exited before it did (and the one torch names);
        among them, the root cause is the rank that stopped writing to stderr first: a rank that
        crashes writes its last line when it dies, and its peers write their "connection closed
        by peer" errors after it.
        """
        now = time.time()
        self._between_attempts = True
        if self.peers is not None and (lost := self.peers.lost()) is not None:
            print(f"lightning run: node {lost[0]} ({lost[1]}) is not responding{WAITING}", file=sys.stderr, flush=True)
        if self.wandb_service is not None:
            self.wandb_service.restart()
        if self.hang is not None:  # the watch stopped the group: its verdict is the failure
            for record in self.hang.failure_records():
                self._append(record)
            self.last_failure = self.hang.reason
            return
        exitcodes = {rank: int(getattr(f, "exitcode", 1)) for rank, f in failures.items()}
        logs = {rank: stderr_files.get(getattr(f, "local_rank", -1)) for rank, f in failures.items()}
        said = {rank: failure_reason(exitcodes[rank], logs[rank]) for rank in failures}  # each log's tail read once
        self.not_retryable = any(code == EXIT_NOT_RETRYABLE for code in exitcodes.values())
        pool = [rank for rank in exitcodes if suspects is None or rank in suspects] or list(exitcodes)
        candidates = [rank for rank in pool if exitcodes[rank] != -signal.SIGTERM] or pool
        candidates = [rank for rank in candidates if exitcodes[rank] == EXIT_NOT_RETRYABLE] or candidates
        # A rank that raised only because another rank failed (an agreement) may write its last line first.
        candidates = [rank for rank in candidates if not follows_another_rank(said[rank])] or candidates
        root = min(candidates, key=lambda rank: (_mtime(logs[rank]), rank))
        for rank in sorted(failures, key=lambda r: (r != root, r)):
            if rank == root:
                reason = said[rank]
                if self.not_retryable:
                    reason += " (not retried: it fails the same way on every attempt)"
                self.last_failure = f"rank {rank} {reason}"
            elif exitcodes[rank] == -signal.SIGTERM or (suspects is not None and rank not in suspects):
                reason = "stopped by the launcher after another rank failed"
            else:
                reason = f"failed after rank {root}: {said[rank]}"
            self._append({"kind": "failure", "attempt": self.attempt, "time": now, "rank": rank,
                                "exitcode": exitcodes[rank], "reason": reason, "root_cause": rank == root})

    def end_record(self, exitcode: int, reason: str) -> dict[str, Any]:
        """The launch's ``end`` record, stamped now (the report is made from it before it is written)."""
        return {"kind": "end", "time": time.time(), "exitcode": exitcode, "reason": reason,
                "attempts": self.attempt - self.first_attempt + 1, "node_rank": self.opts.node_rank}

    def finished(self, end: dict[str, Any]) -> None:
        """Write ``end``, the record the printed report was made from: a later ``lightning-ett report`` reads the same
        job end, so it prints the same figures (the report's own printing is after the job's clock stopped)."""
        if self.peers is not None:
            self.peers.close(finished=True)
        with self._write_lock:
            self.writer.append(end)
            self.writer.close()


def _own_address(main_address: str) -> str | None:
    """This node's address towards node 0, for the report to name it (None where it has none)."""
    from lightning_ett.launch.network import route_source

    return route_source(main_address)


def _forked_worker_args(opts: LaunchOptions, env: dict[str, str]) -> tuple[str, str, str]:
    """The arguments of :func:`lightning_ett.launch.worker.run_script` (strings: torch substitutes macros in them)."""
    return opts.script, json.dumps(list(opts.script_args)), json.dumps(env)


def _exited_local_ranks(pcontext: Any) -> set[int]:
    """Local ranks whose process has already exited (forked workers or subprocesses)."""
    processes = getattr(getattr(pcontext, "_pc", None), "processes", None)
    if processes is not None:
        return {lr for lr, process in enumerate(processes) if process.exitcode is not None}
    handlers = getattr(pcontext, "subprocess_handlers", None) or {}
    return {lr for lr, handler in handlers.items() if handler.proc.poll() is not None}


def _recording_agent_class(recorder: LaunchRecorder) -> type:
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class RecordingAgent(LocalElasticAgent):
        """torchrun's agent, telling the recorder when workers start and why they failed.

        With several nodes it also outlives an unreachable rendezvous store (a network partition): torch's
        agent dies on the first ``RendezvousConnectionError``, here the hang watch decides whether the
        ranks are stalled (a lost node names the cause) and the next rendezvous waits while the store is unreachable.
        """

        def __init__(self, spec: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(spec, *args, **kwargs)
            if recorder.opts.num_nodes > 1:
                _tolerate_unreachable_store(spec.rdzv_handler)

        def _rendezvous(self, worker_group: Any) -> None:
            from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

            from lightning_ett.launch.network import store_answers

            deadline = time.monotonic() + REJOIN_TIMEOUT_S
            said = False
            while True:
                try:
                    return super()._rendezvous(worker_group)
                except RendezvousConnectionError:
                    opts = recorder.opts
                    if opts.num_nodes < 2 or opts.main_port is None or time.monotonic() > deadline \
                            or store_answers(opts.main_address, opts.main_port) != "unreachable":
                        raise  # (a refused connection: node 0's launcher is gone, and with it the job)
                    if not said:
                        said = True
                        print(f"lightning run: the rendezvous store at {recorder.opts.main_address}:"
                              f"{recorder.opts.main_port} does not answer; retrying for up to {REJOIN_TIMEOUT_S:.0f} s",
                              file=sys.stderr, flush=True)
                    time.sleep(2.0)

        def _invoke_run(self, role: str = "default") -> RunResult:
            result = super()._invoke_run(role)
            if recorder.peers is not None:  # before the agent shuts node 0's store: a heartbeat would fail loudly (C++)
                recorder.peers.close(finished=True)
            return result

        def _start_workers(self, worker_group: Any) -> dict[int, Any]:
            env = recorder.starting_workers()
            if recorder.opts.preload:
                opts = recorder.opts
                worker_group.spec.args = _forked_worker_args(opts, env)
            return super()._start_workers(worker_group)

        def _monitor_workers(self, worker_group: Any) -> RunResult:
            stderrs = dict(getattr(self._pcontext, "stderrs", {}) or {})
            recorder.watch_workers({w.global_rank: (w.id, stderrs.get(w.local_rank))
                                    for w in worker_group.workers if w.id is not None})
            exited = _exited_local_ranks(self._pcontext)  # before torch stops the rest of the group
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.FAILED:
                failures = dict(result.failures)
                suspects = set(failures) | {worker_group.workers[lr].global_rank for lr in exited}
                # Forked workers: torch reports only the first failed process; the others' exit codes
                # are needed to tell the root cause from the ranks that died of it.
                processes = getattr(getattr(self._pcontext, "_pc", None), "processes", [])
                for local_rank, process in enumerate(processes):
                    if process.exitcode not in (None, 0):
                        failures.setdefault(worker_group.workers[local_rank].global_rank,
                                            SimpleNamespace(local_rank=local_rank, exitcode=process.exitcode))
                recorder.workers_failed(failures, dict(getattr(self._pcontext, "stderrs", {}) or {}), suspects)
                if recorder.not_retryable:
                    self._remaining_restarts = 0  # the agent then stops instead of restarting the group
            return result

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            groups = set((self._pcontext.pids() if self._pcontext is not None else {}).values())
            _release_finished_workers(self._pcontext)
            if death_sig == signal.SIGINT:  # Ctrl-C: the workers stop as on SIGTERM, at a step boundary with a
                death_sig = signal.SIGTERM  # last checkpoint (a KeyboardInterrupt mid-step would save nothing)
                print("lightning run: stopping every rank after its current step (Ctrl-C again: kill it now)",
                      file=sys.stderr, flush=True)
            if death_sig == signal.SIGTERM and self._pcontext is not None:
                timeout = _stop_workers(self._pcontext, timeout)
            super()._shutdown(death_sig, timeout)
            if recorder.token is not None:  # what the workers started (DataLoader workers, a publisher) goes with them
                sweep_attempt(recorder.token, groups)

    return RecordingAgent


#: How long a node keeps trying to reach an unreachable rendezvous store before its launcher gives up.
REJOIN_TIMEOUT_S = 600.0


def _tolerate_unreachable_store(handler: Any) -> None:
    """While the workers run, torch's agent asks the store every monitor interval whether nodes wait to join, and dies
    on the first connection error. Here an unreachable store reads as "none waiting": the workers run on, and the
    hang watch stops them if they stall on the unreachable node."""
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    asked = handler.num_nodes_waiting

    def num_nodes_waiting() -> int:
        try:
            return asked()
        except RendezvousConnectionError:
            return 0

    handler.num_nodes_waiting = num_nodes_waiting


def _stop_workers(pcontext: Any, timeout: float) -> float:
    """SIGTERM to each worker process — not its process group, as torch sends it to a ``--no-preload`` worker: that
    would kill its DataLoader workers too, and the rank would die mid-step instead of saving — then up to ``timeout``
    for them to exit; returns the time left. A second Ctrl-C (or SIGTERM) meanwhile kills them at once."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    pids = dict(pcontext.pids())
    for pid in pids.values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(_exited_local_ranks(pcontext)) < len(pids):
            time.sleep(0.05)
    except (SignalException, KeyboardInterrupt):
        kill_process_groups(list(pids.values()), signal.SIGKILL)
        return 0.0
    return max(deadline - time.monotonic(), 0.0)


def _release_finished_workers(pcontext: Any) -> None:
    """Let forked workers whose script has ended exit now, not at the kill timeout.

    A worker run as a function (``--preload``) waits, after its script, until the agent has read
    its return value. An agent that is stopping the group (a SIGTERM to the launcher, or a
    restart) never reads it: torch's ``MultiprocessContext._close`` signals the workers but does
    not set that event, so each finished worker sat out the 30 s timeout and was SIGKILLed, and a
    preempted job spent 30 s of the scheduler's grace period doing nothing.

    The event is set from a daemon thread given :data:`RELEASE_TIMEOUT_S`: a multiprocessing
    ``Event.set`` waits for every process that sleeps on it to wake, and a sleeper that died
    (torch's ``ProcessContext.join`` kills the others when one worker fails) never does. Set
    inline, that hung the launcher forever when a rank failed after another had finished.
    """
    event = getattr(pcontext, "_worker_finished_event", None)
    if event is not None:
        setter = threading.Thread(target=event.set, name="ett-release-workers", daemon=True)
        setter.start()
        setter.join(RELEASE_TIMEOUT_S)


#: How long the agent waits for the finished workers' release before it stops them anyway.
RELEASE_TIMEOUT_S = 2.0


class _AgentLogFilter(logging.Filter):
    """torch's agent logs, as the launcher wants them.

    A record's traceback is formatted with the standard formatter: torch's imports ``torch._dynamo``
    (1.4 s here) to format the first traceback it sees — the agent logs one when a worker fails, so each
    restart would wait for it. And once the hang watch stopped the group, the agent's errors about the
    workers it killed are dropped: they name local rank 0 and SIGKILL, not the hung rank and why.
    """

    def __init__(self, recorder: LaunchRecorder | None = None) -> None:
        super().__init__()
        self.recorder = recorder

    def filter(self, record: logging.LogRecord) -> bool:
        if self.recorder is not None and self.recorder.hang is not None and record.levelno >= logging.ERROR:
            return False  # the watch stopped the group and said why: torch's "failed (exitcode: -9) local_rank: 0" misleads
        if record.exc_info:
            record.exc_text = record.exc_text or logging.Formatter().formatException(record.exc_info)
            record.exc_info = None
        return True


_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api",
                  "torch.distributed.elastic.agent.server.local_elastic_agent")


@contextlib.contextmanager
def _agent_class(cls: type, recorder: LaunchRecorder) -> Iterator[None]:
    import torch.distributed.launcher.api as launcher_api

    original = launcher_api.LocalElasticAgent
    launcher_api.LocalElasticAgent = cls
    plain = _AgentLogFilter(recorder)
    for name in _AGENT_LOGGERS:
        logging.getLogger(name).addFilter(plain)
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = original
        for name in _AGENT_LOGGERS:
            logging.getLogger(name).removeFilter(plain)


def torchrun_argv(opts: LaunchOptions) -> list[str]:
    """The torchrun command line this launch amounts to (c10d rendezvous, per-attempt logs), script arguments aside."""
    if opts.num_nodes == 1:
        endpoint = f"localhost:{opts.main_port or 0}"  # what `torchrun --standalone` does
    else:
        endpoint = f"{opts.main_address}:{opts.main_port}"
    return [
        "--nnodes", str(opts.num_nodes), "--nproc-per-node", str(opts.devices),
        "--max-restarts", str(opts.max_restarts), "--monitor-interval", str(opts.monitor_interval),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", opts.job_id,
        # Node 0 hosts the rendezvous store; the others connect to it.
        "--rdzv-conf", f"is_host={str(opts.node_rank == 0).lower()}",
        *(["--local-addr", opts.local_addr] if opts.local_addr else []),
        "--log-dir", str(opts.run_dir / WORKER_LOGS / f"node-{opts.node_rank}"), "--tee", "3",
        opts.script,  # its arguments are appended after parsing: torchrun's parser would take `--monitor` for its own
    ]


#: How long a node's launcher waits for the lock of a launcher on another host that looks alive: node 0 declares a
#: dead node's launcher gone within about SILENT_S + 2 * HEARTBEAT_S of its death, and its lock may then be taken over once
#: it is 30 s silent (three of its heartbeats), at most ~30 s after the death.
REPLACEMENT_PATIENCE_S = 40.0


def launch(opts: LaunchOptions) -> int:
    """Run the job to its end (restarting it up to ``max_restarts`` times); return the exit code.

    Exit code 2, with nothing started or recorded, when a live launcher already owns this node's
    part of the run directory: a second one would interleave its ledger and checkpoints with it.
    """
    job_start = float(os.environ.get(ENV_JOB_START, process_start_time()))
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    several = opts.num_nodes > 1
    owner = OwnerLock(opts.run_dir, run_dir_owner_file(opts.node_rank), opts.job_id,
                      what=f"--run-dir {str(opts.run_dir)!r} (node {opts.node_rank})",
                      fix="Wait for that job to end or stop it (its workers die with its launcher), or pass another "
                      "--run-dir." + (f" If node {opts.node_rank} was lost and this replaces it: that launcher is not "
                                      "gone, or node 0 has not said it stopped responding."
                                      if several and opts.node_rank > 0 else ""),
                      on_takeover=lambda said: print(f"lightning run: warning: {said}", file=sys.stderr))
    try:
        # A replacement for a lost node may start before node 0 has noticed the loss: it waits for that.
        owner.acquire(patience_s=REPLACEMENT_PATIENCE_S if several else 0.0,
                      on_wait=lambda said: print(f"lightning run: {said}", file=sys.stderr, flush=True))
    except DirectoryInUseError as err:
        print(f"lightning run: {err}", file=sys.stderr)
        return 2
    try:
        write_job_file(opts.run_dir, opts.job_id, job_start)
        opts = _reachable(opts)
        os.environ.update({
            ENV_RUN_DIR: str(opts.run_dir), ENV_JOB_ID: opts.job_id, ENV_JOB_START: repr(job_start),
            ENV_LAUNCHER: "lightning run", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            ENV_LAUNCHER_PID: str(os.getpid()),  # the forkserver and the workers die with this process
        })
        if opts.hang.enabled:
            os.environ[ENV_HANG_WATCH] = "1"  # ranks announce phase starts and dump stacks on request
        else:
            os.environ.pop(ENV_HANG_WATCH, None)
        sweeper = Sweeper()  # before anything of the job starts: all of it carries the sweeper's token
        from lightning_ett.launch.worker import MENTIONS_WANDB, mentions

        try:
            service = WandbService() if mentions(MENTIONS_WANDB, opts.script, opts.script_args) else None
            recorder = LaunchRecorder(opts, job_start, service, token=sweeper.token)
            if opts.num_nodes > 1 and opts.main_port is not None:
                recorder.peers = PeerWatch(opts.main_address, opts.main_port, opts.job_id, opts.node_rank,
                                           opts.num_nodes, recorder.address or socket.gethostname(), on_event=recorder.peer_event,
                                           on_stop=recorder.stopped_by_node0,
                                           owner_token=owner.owner.token if owner.owner else None).start()
                if recorder.watch is not None and opts.node_rank == 0:
                    recorder.watch.lost_node = recorder.peers.lost
            try:
                return _launch(opts, recorder)
            except KeyboardInterrupt:  # Ctrl-C before the agent took over its signals (importing torch): a stop
                return _finish(opts, recorder, 128 + signal.SIGINT, stop_reason(opts.run_dir, signal.SIGINT, recorder.attempt),
                               failed=True)
            except BaseException as err:
                recorder.finished(recorder.end_record(1, f"launcher error: {type(err).__name__}: {err}"))
                raise
        finally:
            sweeper.close()
    finally:
        owner.release()


def _reachable(opts: LaunchOptions) -> LaunchOptions:
    """With several nodes: advertise an address the other nodes can reach, and give gloo its interface.

    torch advertises the hostname (``socket.getfqdn()``) and gloo binds to what it resolves to; where
    that is loopback, the other nodes' workers would wait 30 minutes for a store they cannot reach
    (:mod:`lightning_ett.launch.network`). Only then is anything changed: a hostname that resolves to a
    real address keeps torch's and gloo's choices, and ``GLOO_SOCKET_IFNAME`` set by the user is left alone.
    """
    if opts.num_nodes < 2:
        return opts
    from lightning_ett.launch.network import ENV_ONE_MACHINE, advertised_address, interface_with, is_loopback_ip

    if is_loopback_ip(opts.main_address):
        os.environ[ENV_ONE_MACHINE] = "1"  # (a loopback IP: the workers' store check accepts a loopback store)
    if opts.local_addr is not None:
        return opts
    address, why = advertised_address(opts.main_address)
    if address is None:
        return opts
    interface = None if "GLOO_SOCKET_IFNAME" in os.environ else interface_with(address)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface  # gloo would bind to the hostname's address: loopback
        why += f" gloo uses its interface, {interface} (GLOO_SOCKET_IFNAME)."
    print(f"lightning run: {why}", file=sys.stderr, flush=True)
    return replace(opts, local_addr=address)


def _launch(opts: LaunchOptions, recorder: LaunchRecorder) -> int:
    if opts.preload:
        from lightning_ett.launch.worker import modules_to_preload, start_forkserver

        # Its imports overlap the launcher's own and the rendezvous.
        start_forkserver(modules_to_preload(opts.script, opts.script_args))

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, parse_args

    config, entrypoint, args = config_from_args(parse_args(torchrun_argv(opts)))
    # Not `python -u SCRIPT`: a fresh worker prepares itself as a forked one does (lightning_ett.launch.fresh_worker).
    entrypoint, args = sys.executable, ["-u", "-m", "lightning_ett.launch.fresh_worker", opts.script, *opts.script_args]
    if opts.preload:
        from lightning_ett.launch.worker import run_script

        config.start_method = "forkserver"
        entrypoint, args = run_script, list(_forked_worker_args(opts, {}))  # the env is set per attempt
    try:
        with _agent_class(_recording_agent_class(recorder), recorder):
            elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as err:
        attempts = recorder.attempt - recorder.first_attempt + 1
        cause = recorder.last_failure or _root_cause(err)
        reason = f"gave up after {attempts} attempt(s) (--max-restarts {opts.max_restarts}); last failure: {cause}"
        return _finish(opts, recorder, 1, reason, failed=True)
    except (KeyboardInterrupt, SignalException) as err:
        sig = signal.Signals(getattr(err, "sigval", signal.SIGINT))
        return _finish(opts, recorder, 128 + int(sig), stop_reason(opts.run_dir, sig, recorder.attempt), failed=True)
    return _finish(opts, recorder, 0, "finished", failed=False)


def _finish(opts: LaunchOptions, recorder: LaunchRecorder, exitcode: int, reason: str, failed: bool) -> int:
    """Stop the job's clock, print the report made with that end, then write the end record it was made from."""
    if opts.preload:
        from lightning_ett.launch.worker import stop_forkserver

        stop_forkserver()
    if recorder.wandb_service is not None:
        recorder.wandb_service.stop()  # the runs' last records are written before the job ends
    end = recorder.end_record(exitcode, reason)
    _print_report(opts, end, failed=failed)
    recorder.finished(end)
    return exitcode


def stop_reason(run_dir: Path, sig: signal.Signals, attempt: int) -> str:
    """``stopped by the user (SIGINT) at step N, checkpoint at step M``: where a signal stopped ``attempt``, from the
    ledger (its steps; the checkpoints AsyncCheckpoint recorded in the job)."""
    who = "the user (SIGINT)" if sig == signal.SIGINT else sig.name
    try:
        ledgers = read_ledger(run_dir)
    except (OSError, ValueError):
        return f"stopped by {who}"
    steps = [e["step"] for lg in ledgers if lg.attempt == attempt for e in lg.events
             if e["phase"] == Phase.TRAIN.value and e.get("step") is not None]
    saved = [f["step"] for lg in ledgers for f in lg.facts if f.get("name") == CHECKPOINT_FACT and "step" in f]
    where = f" at step {max(steps) + 1}" if steps else " before training"
    checkpoint = f", checkpoint at step {max(saved)}" if saved else ", no AsyncCheckpoint checkpoint recorded"
    return f"stopped by {who}{where}{checkpoint}"


def _root_cause(err: Any) -> str:
    rank, failure = err.get_first_failure()
    return f"rank {rank} exit code {failure.exitcode}"


def _print_report(opts: LaunchOptions, end: dict[str, Any], failed: bool) -> None:
    """The job's report, made with ``end`` (the launcher's end record, written once the report is out)."""
    from rich.console import Console
    from rich.markup import escape

    console = Console()
    if failed:
        Console(stderr=True).print(f"[bold red]lightning run: {escape(end['reason'])}[/bold red]")
    if opts.node_rank != 0:
        console.print(f"[dim]ETT report: node 0 prints it; or run `lightning-ett report {opts.run_dir}`.[/dim]")
        return
    from lightning_ett.instrument.report import REPORT_PNG, write_report
    from lightning_ett.instrument.summary import summarize

    try:
        launcher = [*read_launcher_records(opts.run_dir), end]
        summary = summarize(read_ledger(opts.run_dir), launcher=launcher)
        write_report(summary, opts.run_dir, console)
    except (FileNotFoundError, ValueError) as err:
        console.print(f"[yellow]No ETT report: {escape(str(err))}[/yellow]")
        return
    except Exception as err:  # noqa: BLE001 - the job's outcome stands; the report can be made again
        console.print(f"[yellow]Could not write the ETT report ({escape(repr(err))}); "
                      f"try `lightning-ett report {opts.run_dir}`.[/yellow]")
        return
    console.print(f"[dim]{opts.run_dir / REPORT_PNG}  ·  lightning-ett report {opts.run_dir}[/dim]",
                  soft_wrap=not console.is_terminal)
    sys.stdout.flush()


__all__ = ["LaunchOptions", "failure_reason", "launch", "next_attempt", "torchrun_argv"]
