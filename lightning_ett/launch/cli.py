"""``lightning-ett`` / ``lightning`` command line: ``run`` starts a job, ``report`` reads its ledger back, ``tune``
searches a script's knobs.

Argument checks happen here, before torch is imported, so a typo fails in a fraction of a
second with the option named.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from rich.console import Console

if TYPE_CHECKING:
    from lightning_ett.launch.hang_response import HangOptions
    from lightning_ett.launch.launcher import LaunchOptions


def _report(args: argparse.Namespace) -> int:
    from lightning_ett.instrument.report import REPORT_PNG, print_report, write_report
    from lightning_ett.instrument.summary import SUMMARY_FILE, summarize_run_dir

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"lightning-ett report: RUN_DIR {str(run_dir)!r} is not a directory.", file=sys.stderr)
        return 2
    try:
        summary = summarize_run_dir(run_dir)
        if args.now and summary.outcome is None:  # (--now: a running job's wall time so far; an ended job has its end)
            summary = summarize_run_dir(run_dir, now=time.time())
    except (FileNotFoundError, ValueError) as err:
        print(f"lightning-ett report: {err}", file=sys.stderr)
        return 2
    console = Console()
    if _unchanged(run_dir / SUMMARY_FILE, summary.to_dict()) and (run_dir / REPORT_PNG).is_file():
        print_report(summary, console)  # (a finished job has one answer: read back, its files left as they are)
    else:
        write_report(summary, run_dir, console)
    console.print(f"[dim]{run_dir / SUMMARY_FILE}\n{run_dir / REPORT_PNG}[/dim]")
    return 0


def _unchanged(path: Path, summary: dict[str, Any]) -> bool:
    """Does ``path`` already hold ``summary``, byte for byte as :meth:`Summary.write_json` writes it?"""
    try:
        return path.read_text() == json.dumps(summary, indent=2) + "\n"
    except (OSError, ValueError):
        return False


def _int_parser(low: int, high: int, expected: str) -> Callable[[str], int]:
    """An argparse ``type`` for an integer in ``[low, high]``; the error says what was ``expected``."""

    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if not low <= number <= high:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {value!r}")
        return number

    return parse


_positive_int = _int_parser(1, sys.maxsize, "an integer >= 1")
_non_negative_int = _int_parser(0, sys.maxsize, "an integer >= 0")
_port = _int_parser(1, 65535, "a TCP port 1-65535")
_device_count = _int_parser(1, sys.maxsize, "an integer >= 1 or 'auto'")


def _devices(value: str) -> int:
    """An integer >= 1, or ``auto``: the visible GPUs, or one process on a machine without any."""
    if value == "auto":
        import torch

        return torch.cuda.device_count() or 1
    return _device_count(value)


def _add_run_parser(sub: argparse._SubParsersAction) -> None:
    from lightning_ett.launch.launcher import DEFAULT_MAX_RESTARTS

    run = sub.add_parser(
        "run", help="Start a training script on this node under PyTorch's elastic launcher, restart it on failure, "
        "and print the job's ETT report at the end.",
        description="Spelled as `fabric run`, with torchrun's spellings as aliases. `lightning run model SCRIPT` "
        "(the older spelling) works too.",
    )
    run.add_argument("--devices", "--nproc-per-node", "--nproc_per_node", type=_devices, default=1, metavar="N",
                     help="Processes on this node (one per GPU), or 'auto'. Match the Trainer's `devices`. Default 1.")
    run.add_argument("--num-nodes", "--num_nodes", "--nnodes", type=_positive_int, default=None, metavar="N",
                     help="Nodes in the job; start one `lightning run` per node. Match the Trainer's `num_nodes`. "
                     "Default 1, or $SLURM_NNODES inside a SLURM allocation.")
    run.add_argument("--node-rank", "--node_rank", type=_non_negative_int, default=None, metavar="R",
                     help="This node's rank; node 0 hosts the rendezvous at --main-address:--main-port. Default 0, or "
                     "$SLURM_NODEID under SLURM.")
    run.add_argument("--main-address", "--main_address", "--master-addr", default=None, metavar="HOST",
                     help="Address of node 0, reachable from every node (default 127.0.0.1, or the first host of "
                     "$SLURM_JOB_NODELIST under SLURM).")
    run.add_argument("--main-port", "--main_port", "--master-port", type=_port, default=None, metavar="PORT",
                     help="Rendezvous port on node 0 (default 29400 with several nodes, a free port with one).")
    run.add_argument("--local-addr", "--local_addr", default=None, metavar="ADDRESS",
                     help="The address this node advertises to the others (torchrun's --local-addr). Default: its "
                     "hostname, or, with several nodes where that resolves to loopback, its address on the route to "
                     "--main-address.")
    run.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None, metavar="HOST:PORT",
                     help="torchrun's spelling of --main-address and --main-port together.")
    run.add_argument("--max-restarts", "--max_restarts", type=_non_negative_int, default=DEFAULT_MAX_RESTARTS,
                     metavar="N", help=f"Restarts after a failure before giving up (default {DEFAULT_MAX_RESTARTS}).")
    run.add_argument("--run-dir", "--run_dir", default=None, metavar="DIR",
                     help="The job's run directory (ledger, report, worker logs). A relaunch into the same directory "
                     "continues the job. Default: $LIGHTNING_ETT_RUN_DIR or ./ett_runs/<job id>.")
    run.add_argument("--job-id", "--job_id", "--rdzv-id", "--rdzv_id", default=None, metavar="ID",
                     help="The job's id, the same on every node (default: the run directory's).")
    run.add_argument("--preload", dest="preload", action="store_true", default=True,
                     help="Fork workers from a server that imported torch, Lightning and TorchRec once (default).")
    run.add_argument("--no-preload", dest="preload", action="store_false",
                     help="Start each worker as a fresh `python SCRIPT` instead of forking it from a server that "
                     "imported torch, Lightning and TorchRec once per node.")
    run.add_argument("--progress-every", "--progress_every", type=float, default=None, metavar="SECONDS",
                     help="Print a progress line (step, steps/s, ETT%% so far, phase) every SECONDS on node 0 "
                     "(default 30; 0: none).")
    hang = run.add_argument_group("hang watch", "A job none of whose ranks makes progress (ledger, collectives, CPU, "
                                  "I/O, stack) for longer than its phase allows is hung: its stacks are dumped into "
                                  "RUN_DIR/stacks/, the rank the others wait for is named, and the group is stopped and "
                                  "restarted (counted against --max-restarts).")
    hang.add_argument("--hang-timeout", "--hang_timeout", action="append", default=[], metavar="PHASE=SECONDS",
                      help="Fix PHASE's limit at SECONDS, never learned (repeatable). PHASE: startup, train, compile, "
                      "checkpoint_load, checkpoint_save, eval, data_init, publish, shutdown. Unfixed limits are "
                      "generous defaults (600 s; compile and eval 1800 s) until the phase was seen 3 times, then "
                      "--hang-safety-factor x its longest time so far, never under --hang-min-limit.")
    hang.add_argument("--hang-safety-factor", "--hang_safety_factor", "--hang-step-factor", type=float, default=None,
                      metavar="X", help="A learned limit is X times the longest time the phase took so far (default 5).")
    hang.add_argument("--hang-min-limit", "--hang_min_limit", type=float, default=None, metavar="SECONDS",
                      help="No learned limit is shorter than this (default 10).")
    hang.add_argument("--hang-grace", "--hang_grace", type=float, default=None, metavar="SECONDS",
                      help="Between SIGTERM and SIGKILL when a hung group is stopped (default 1: a hung rank "
                      "rarely exits on SIGTERM, and nothing needs the wait: checkpoints commit atomically, W&B "
                      "records live in the launcher's service).")
    hang.add_argument("--no-hang-watch", dest="hang_watch", action="store_false", default=True,
                      help="Do not watch for hangs (a hung job then waits for its process-group timeout).")
    run.add_argument("script", metavar="SCRIPT", help="The training script.")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="SCRIPT_ARGS", help="Arguments for SCRIPT.")
    run.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        opts = _launch_options(args)
    except ValueError as err:
        print(f"lightning run: {err}", file=sys.stderr)
        return 2
    from lightning_ett.launch.launcher import launch

    return launch(opts)


def _launch_options(args: argparse.Namespace) -> LaunchOptions:
    """Check what argparse cannot check alone, and fill in the defaults that depend on each other."""
    import re

    from lightning_ett.durable.files import writable_dir_error
    from lightning_ett.instrument.environment import DEFAULT_RUNS_ROOT, ENV_RUN_DIR, _new_job_id, read_job_file
    from lightning_ett.launch.launcher import LaunchOptions

    script = Path(args.script)
    if not script.is_file():
        raise ValueError(f"SCRIPT {args.script!r} is not a file (looked in {os.getcwd()!r}).")
    _fill_from_slurm(args, os.environ)
    if args.node_rank >= args.num_nodes:
        raise ValueError(f"--node-rank {args.node_rank} is out of range for --num-nodes {args.num_nodes} "
                         f"(expected 0..{args.num_nodes - 1}).")
    address, port = args.main_address, args.main_port
    if args.rdzv_endpoint is not None:
        host, sep, port_text = args.rdzv_endpoint.rpartition(":")
        if not sep or not host:
            raise ValueError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: expected HOST:PORT, e.g. node0:29400.")
        try:
            endpoint_port = _port(port_text)
        except argparse.ArgumentTypeError as err:
            raise ValueError(f"--rdzv-endpoint {args.rdzv_endpoint!r}: {err}.") from None
        if (address not in (None, host)) or (port not in (None, endpoint_port)):
            raise ValueError("--rdzv-endpoint disagrees with --main-address/--main-port: pass one or the other.")
        address, port = host, endpoint_port
    if args.num_nodes > 1 and address is None:
        raise ValueError("with --num-nodes > 1 pass --main-address: node 0's address, reachable from every node.")
    if args.num_nodes > 1 and port is None:
        port = 29400
    run_dir = args.run_dir or os.environ.get(ENV_RUN_DIR)
    job_id = args.job_id
    if run_dir is not None:
        recorded = read_job_file(Path(run_dir).expanduser().absolute()) or {}
        job_id = job_id or recorded.get("job_id") or Path(run_dir).name
    elif args.num_nodes > 1 and job_id is None:
        raise ValueError("with --num-nodes > 1 every node must name the same job: pass the same --run-dir "
                         "(on shared storage) or --job-id to each node's `lightning run`.")
    job_id = re.sub(r"[^A-Za-z0-9_.-]", "_", job_id or _new_job_id())
    path = Path(run_dir or Path(DEFAULT_RUNS_ROOT) / job_id).expanduser().absolute()
    if writable_dir_error(path, "--run-dir") is not None:
        raise ValueError(f"--run-dir {str(path)!r} is not writable: pass a directory this job can create files in.")
    hang = _hang_options(args)
    _check_fault_switches()
    from lightning_ett.launch.progress_line import DEFAULT_EVERY_S

    progress = DEFAULT_EVERY_S if args.progress_every is None else args.progress_every
    if not progress >= 0 or progress == float("inf"):
        raise ValueError(f"--progress-every {args.progress_every!r}: expected seconds >= 0 (0: no progress line).")
    return LaunchOptions(
        hang=hang, script=str(script), script_args=tuple(args.script_args), devices=args.devices, num_nodes=args.num_nodes,
        node_rank=args.node_rank, main_address=address or "127.0.0.1", main_port=port, local_addr=args.local_addr,
        max_restarts=args.max_restarts, run_dir=path, job_id=job_id, preload=args.preload, progress_every_s=progress,
    )


def _fill_from_slurm(args: argparse.Namespace, env: dict[str, str] | os._Environ[str]) -> None:
    """Inside a SLURM allocation (one ``lightning run`` per node, e.g. ``srun --ntasks-per-node=1``), read the nodes,
    this node's rank, node 0's host (the step's first), a port from the job id (as Lightning does) and the job id
    from SLURM's variables; an explicit flag wins. Several tasks per node are refused: each would start every rank."""
    if "SLURM_JOB_ID" not in env or "SLURM_NNODES" not in env:
        args.num_nodes, args.node_rank = args.num_nodes or 1, args.node_rank or 0
        return
    tasks = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    if "SLURM_LOCALID" in env and not tasks.split("(")[0].split(",")[0] == "1":
        raise ValueError(f"this SLURM step runs {tasks} tasks per node (SLURM_STEP_TASKS_PER_NODE); `lightning run` "
                         "starts every process of its node itself: run one per node, e.g. `srun --ntasks-per-node=1 "
                         "lightning run --devices 8 ...`.")
    from_slurm = []
    if args.num_nodes is None:
        args.num_nodes = _slurm_int(env, "SLURM_NNODES")
        from_slurm.append(f"--num-nodes {args.num_nodes}")
    if args.node_rank is None:
        args.node_rank = _slurm_int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        from_slurm.append(f"--node-rank {args.node_rank}")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")  # (a step may run on part of the job)
    if args.main_address is None and args.rdzv_endpoint is None and nodelist:
        args.main_address = first_slurm_host(nodelist)
        from_slurm.append(f"--main-address {args.main_address}")
    if args.main_port is None and args.rdzv_endpoint is None and args.num_nodes > 1:
        job = "".join(c for c in env["SLURM_JOB_ID"] if c.isdigit())[-4:] or "0"
        args.main_port = 15000 + int(job)  # as Lightning's SLURMEnvironment: two jobs on one node do not collide
        from_slurm.append(f"--main-port {args.main_port}")
    if args.job_id is None and args.run_dir is None:
        args.job_id = f"slurm-{env['SLURM_JOB_ID']}"
        from_slurm.append(f"--job-id {args.job_id}")
    if from_slurm and args.node_rank == 0:
        print(f"lightning run: SLURM job {env['SLURM_JOB_ID']}: {' '.join(from_slurm)}", file=sys.stderr, flush=True)


def _slurm_int(env: dict[str, str] | os._Environ[str], name: str) -> int:
    try:
        return _non_negative_int(env[name])
    except argparse.ArgumentTypeError as err:
        raise ValueError(f"${name}={env[name]!r}: {err}; pass the matching `lightning run` flag instead.") from None


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list, as ``scontrol show hostnames`` would print it first.

    Lightning's ``SLURMEnvironment.resolve_root_node_address`` does the same but imports torch; this
    runs before torch is imported, so a bad flag fails at once. ``node[07-09,12],gpu5`` -> ``node07``.
    """
    import re

    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):  # the first item: up to the first comma outside brackets
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    item = nodelist[:end].strip()
    if not item or depth < 0 or not re.fullmatch(r"[^\[\],]+(\[[0-9,\-]+\][^\[\],]*)*", item):
        raise ValueError(f"$SLURM_JOB_NODELIST={nodelist!r}: not a SLURM node list; pass --main-address.")
    return re.sub(r"\[([0-9]+)[^\]]*\]", r"\1", item)  # each range's first value, its zero padding kept


def _check_fault_switches() -> None:
    """A malformed ``LIGHTNING_ETT_FAULT_*`` fails here, before any worker starts (the error names the variable)."""
    from lightning_ett.lifecycle import faults

    faults.faults_from_env()
    faults.random_failures_from_env()
    faults.hang_faults_from_env()
    faults.slow_fault_from_env()


def _hang_options(args: argparse.Namespace) -> HangOptions:
    """``--hang-*`` flags as :class:`HangOptions`; a bad value names its flag and the expected form."""
    from lightning_ett.launch.hang_response import HangOptions
    from lightning_ett.watch.limits import HangTimeouts

    timeouts: dict[str, float] = {}
    learning: dict[str, float] = {}
    phases = HangTimeouts.phases()
    for item in args.hang_timeout:
        phase, sep, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if not sep or phase not in phases or not seconds > 0:
            raise ValueError(f"--hang-timeout {item!r}: expected PHASE=SECONDS with SECONDS > 0 and PHASE one of "
                             f"{', '.join(phases)}; e.g. --hang-timeout train=60.")
        timeouts[phase] = seconds
    for flag, name, value in (("--hang-safety-factor", "safety_factor", args.hang_safety_factor),
                              ("--hang-min-limit", "min_limit", args.hang_min_limit)):
        if value is not None:
            if not value > 0:
                raise ValueError(f"{flag} {value!r}: expected a number > 0, e.g. {5 if name == 'safety_factor' else 10}.")
            learning[name] = value
    grace = {} if args.hang_grace is None else {"grace_s": args.hang_grace}  # HangOptions checks it, naming the flag
    return HangOptions(timeouts=HangTimeouts(**learning).with_fixed(**timeouts), enabled=args.hang_watch, **grace)


def build_parser(prog: str = "lightning-ett") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Effective Training Time tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run_parser(sub)
    report = sub.add_parser("report", help="Print the ETT table and write ett_summary.json and the PNG for a run.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="The job's run directory (holds ledger/).")
    report.add_argument(
        "--now", action="store_true", help="For a running job: count wall time up to now, not the last event."
    )
    report.set_defaults(func=_report)
    from lightning_ett.tune import cli as tune_cli  # (its heavy imports wait until a tune runs)

    tune_cli.add_parser(sub)
    return parser


def _normalize(argv: Sequence[str] | None) -> list[str]:
    """Accept the older ``run model SCRIPT`` spelling (Lightning 2.0's ``lightning run model``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:2] == ["run", "model"] and not Path("model").is_file():
        del args[1]
    return args


def main(argv: Sequence[str] | None = None, prog: str = "lightning-ett") -> int:
    """Run a command; as the process's entry point (``argv`` None), ``run`` exits without interpreter teardown."""
    argv_list = _normalize(argv)
    parser = build_parser(prog)
    if argv_list[:1] == ["tune"]:  # tune's unknown arguments are the script's
        from lightning_ett.tune import cli as tune_cli

        args, script_args = parser.parse_known_args(argv_list)
        return tune_cli.run(args, [a for a in script_args if a != "--"])
    args = parser.parse_args(argv_list)
    code = args.func(args)
    if argv is None and args.command == "run":
        _exit_now(code)
    return code


def _exit_now(code: int) -> NoReturn:
    """Exit after the exit handlers, skipping the module teardown (≈ 1 s with torch imported).

    The launcher's job is over once its ledger has the end record; the user's shell (and a
    scheduler's slot) should not wait for the interpreter to free torch's modules. Exit
    handlers still run, as in the forked workers (:mod:`lightning_ett.launch.worker`).
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def lightning_main() -> int:
    """The ``lightning`` executable (Lightning 2.6 ships none): ``lightning run`` and ``lightning report``."""
    return main(prog="lightning")


if __name__ == "__main__":
    sys.exit(main())
