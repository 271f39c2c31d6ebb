"""The worker side of ``lightning run``: run the user's script in a process forked from a
server that already imported torch, Lightning and TorchRec.

Why: every attempt of a job re-imports them in every rank (≈ 3 s per rank on a 2-core
machine, more with CUDA and a large site-packages), and a restart pays it again. The
launcher starts one multiprocessing *forkserver* per node, which imports them once
(:func:`modules_to_preload`); every worker of every attempt is forked from it, with those modules
already in memory (CUDA untouched, so each child still initializes its own GPU).

The script runs as ``python SCRIPT ARGS`` would run it: ``__name__ == "__main__"``,
``sys.argv``, ``sys.path[0]`` = the script's directory. Exit handlers (``atexit``) run when the
script ends, as at a normal interpreter exit — multiprocessing children skip them — and the
interpreter's own module teardown (≈ 1 s with torch) is skipped, which is safe once they ran.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import runpy
import signal
import sys
import threading
from pathlib import Path

from lightning_ett.instrument.environment import ENV_ATTEMPT, ENV_HANG_WATCH, ENV_RUN_DIR

#: Imported once per node by the forkserver (through :mod:`lightning_ett.launch.preload`): what
#: every Lightning + TorchRec script imports.
PRELOAD: tuple[str, ...] = (
    "torch", "torch.distributed", "lightning.pytorch", "lightning.pytorch.cli", "torchrec", "torchmetrics",
    "lightning_ett.callbacks", "lightning_ett.strategies",
)
#: Preloaded too when the job compiles (:func:`modules_to_preload`).
COMPILE_PRELOAD: tuple[str, ...] = ("torch._dynamo", "torch._inductor.compile_fx")
# Not preloaded: wandb. Its import creates a process-wide media directory (``wandb-media`` in
# TMPDIR) that the first worker to exit deletes, so every later attempt forked from the same
# server failed to log a table or an image.
#: The forkserver reads its list here (it inherits the launcher's environment when it starts).
ENV_PRELOAD = "LIGHTNING_ETT_PRELOAD"

_MENTIONS_COMPILE = re.compile(r"compile", re.IGNORECASE)
MENTIONS_WANDB = re.compile(r"wandb", re.IGNORECASE)
#: A job whose script or config names ETTMonitor writes ledgers: the hang watch watches it from its first instant.
MENTIONS_MONITOR = re.compile(r"ETTMonitor")
_CONFIG_SUFFIXES = (".py", ".yaml", ".yml", ".json")


def mentions(pattern: re.Pattern[str], script: str, script_args: tuple[str, ...] = ()) -> bool:
    """Whether the script, or a config file among its arguments, matches ``pattern`` (a text search).

    How the launcher guesses what a job will use before it runs: a match in a comment counts,
    and a module imported from elsewhere is not read.
    """
    values = [arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg for arg in script_args]  # --config=x
    paths = [script, *(arg for arg in values if arg.endswith(_CONFIG_SUFFIXES))]
    for path in paths:
        try:
            text = Path(path).read_text(errors="replace")
        except OSError:
            continue
        if pattern.search(text):
            return True
    return False


def modules_to_preload(script: str, script_args: tuple[str, ...] = ()) -> tuple[str, ...]:
    """:data:`PRELOAD`, plus :data:`COMPILE_PRELOAD` when the script or a config file it is given mentions "compile".

    The first attempt's workers wait for the forkserver's preload, which runs on one core.
    Inductor's import adds about 1.5 s to it (2 cores), so preloading it for a job that never
    compiles made ``lightning run`` start slower than ``torchrun``, whose workers import only what
    they use. A job that compiles gets it preloaded, so its restarts skip that import. A
    model compiled in another module is not seen (:func:`mentions`): its workers then import
    inductor themselves, as under torchrun.
    """
    return PRELOAD + COMPILE_PRELOAD if mentions(_MENTIONS_COMPILE, script, script_args) else PRELOAD


def start_forkserver(modules: tuple[str, ...] = PRELOAD) -> None:
    """Start the node's forkserver now, so that its imports run while the launcher does its own.

    It inherits this process's environment as it is now: call it after the job's variables are set.
    """
    import multiprocessing
    from multiprocessing import forkserver

    # `torch.cuda.is_available()` (fbgemm_gpu calls it at import) would initialize the CUDA
    # driver in the forkserver, and a forked child could not use CUDA; NVML answers instead.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")  # as torchrun's `python -u`: output reaches the logs at once
    os.environ[ENV_PRELOAD] = ",".join(modules)
    multiprocessing.set_forkserver_preload(["lightning_ett.launch.preload"])
    forkserver.ensure_running()


def stop_forkserver() -> None:
    """End the node's forkserver once the job is over (no-op if none runs).

    Left alone, it notices the launcher's exit only afterwards and then tears its interpreter
    down (≈ 1 s with torch imported): an orphan that outlived ``lightning run`` and held its
    output pipe open, so ``lightning run … | tee log`` waited for it. Its workers are gone and it
    holds nothing else, so it is killed; the standard library's own stop then closes its socket.
    """
    from multiprocessing import forkserver

    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    server._stop()


def run_script(script: str, script_args_json: str, env_json: str) -> None:
    """Entry point of each forked worker (a picklable module-level function, for the forkserver)."""
    # The forkserver's environment is the launcher's at its start; values set per attempt come here.
    os.environ.update(json.loads(env_json))
    prepare_worker(forked_by_server=True)
    _apply_thread_count()
    _check_cuda_untouched()
    run_as_main(script, json.loads(script_args_json))


def prepare_worker(forked_by_server: bool) -> None:
    """What every worker of ``lightning run`` does before the first line of the script, forked or fresh.

    It dies with the launcher (a SIGKILLed launcher leaves no worker training on its own), leads a
    process group of its own (stopping the group stops what it starts: DataLoader workers, a publisher),
    on a node without rank 0 fails fast if rank 0's store cannot be reached, and, under the hang watch,
    dumps its stacks and serves its flight recorder on request, so a hang is watched from the first
    instant, whether the script uses ETTMonitor or not.
    """
    from lightning_ett.lifecycle.lifeline import hold_on_to_launcher
    from lightning_ett.lifecycle.sweeper import lead_process_group

    hold_on_to_launcher(forked_by_server=forked_by_server)
    lead_process_group()
    if os.environ.get(ENV_HANG_WATCH):
        from lightning_ett.watch import flight_recorder
        from lightning_ett.watch.stacks import register_dump_signal, stack_dump_path

        rank, attempt, run_dir = int(os.environ.get("RANK", "0")), os.environ.get(ENV_ATTEMPT, ""), os.environ.get(ENV_RUN_DIR)
        dumps = stack_dump_path(run_dir, int(attempt), rank) if run_dir and attempt.isdigit() else None
        register_dump_signal(dumps)
        flight_recorder.serve(rank)
    from lightning_ett.launch.network import exit_if_store_unreachable

    exit_if_store_unreachable(EXIT_NOT_RETRYABLE)  # seconds, not the process group's 30-minute timeout


#: A worker's exit code for an error that fails the same way on every attempt (sysexits' EX_CONFIG): the
#: launcher ends the job at once instead of retrying it ``--max-restarts`` times.
EXIT_NOT_RETRYABLE = 78



def not_retryable(error: BaseException) -> bool:
    """Whether ``error`` will fail the same way on every attempt: a configuration the job cannot run with.

    Our arguments' checks (:class:`~lightning_ett.durable.errors.ConfigurationError`), a directory a live
    job owns, Lightning's ``MisconfigurationException``, a script that does not compile, and, before training
    began, an import that fails (a missing package) or, at the job's first attempt, a ``fit(ckpt_path=...)``
    Lightning cannot open or another run's LightningCLI config file in the log dir. An import that fails later
    can be a race that a retry mends (two processes building one extension or compile cache), so it is retried.
    """
    from lightning_ett.durable.errors import ConfigurationError
    from lightning_ett.durable.ownership import DirectoryInUseError
    from lightning_ett.instrument.timeline import Phase, get_timeline

    kinds: tuple[type, ...] = (ConfigurationError, DirectoryInUseError, SyntaxError)
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")
    if exceptions is not None:
        kinds += (exceptions.MisconfigurationException,)
    trained = get_timeline().exclusive_s.get(Phase.TRAIN.value, 0.0) > 0
    return any(isinstance(e, kinds) or (not trained and (isinstance(e, ImportError) or _refused_by_lightning_at_first_attempt(e)))
               for e in _chain(error))


#: Where Lightning refuses a job at its start the same way on every attempt: (the errors, the file, the function, a
#: phrase its message holds).
_LIGHTNING_REFUSALS: tuple[tuple[tuple[type[BaseException], ...], str, str, str], ...] = (
    # fit(ckpt_path=...) names nothing Lightning can open (missing, an empty directory): its load of the file
    ((FileNotFoundError, IsADirectoryError, NotADirectoryError), os.path.join("connectors", "checkpoint_connector.py"),
     "resume_start", ""),
    # LightningCLI's SaveConfigCallback finds another run's config.yaml in the log dir (a later attempt of this job
    # overwrites its own: ETTMonitor); its setup also makes collectives, whose errors (a peer gone) are RuntimeErrors
    ((RuntimeError,), os.path.join("lightning", "pytorch", "cli.py"), "setup", "to NOT exist. Aborting to avoid"),
)


def _refused_by_lightning_at_first_attempt(error: BaseException) -> bool:
    """At a job's first attempt, one of :data:`_LIGHTNING_REFUSALS`: raised there, it fails the same way on every
    attempt. Not at a later attempt (a checkpoint a restart resumes from may be one the storage does not show yet),
    nor the same errors raised elsewhere (a user's hook, a save's file), nor a load of a checkpoint the pack chose."""
    from lightning_ett.durable.errors import CHOSEN_CHECKPOINT_ATTR

    if os.environ.get(ENV_ATTEMPT) != "0" or getattr(error, CHOSEN_CHECKPOINT_ATTR, False):
        return False
    places = [(where, name) for kinds, where, name, phrase in _LIGHTNING_REFUSALS
              if isinstance(error, kinds) and phrase in str(error)]
    tb = error.__traceback__
    while places and tb is not None:
        code = tb.tb_frame.f_code
        if any(code.co_name == name and code.co_filename.endswith(where) for where, name in places):
            return True
        tb = tb.tb_next
    return False


def _chain(error: BaseException) -> list[BaseException]:
    """``error`` and what it was raised from or while handling: LightningCLI's jsonargparse wraps an argument check
    of a callback built from YAML in a ``ValueError`` ("Does not validate against any of the Union subtypes")."""
    seen: list[BaseException] = []
    while error is not None and all(error is not e for e in seen):
        seen.append(error)
        error = error.__cause__ or error.__context__  # type: ignore[assignment]
    return seen


def _root_configuration_error(innermost: BaseException) -> str:
    """The innermost not-retryable error of a chain as ``module.Class: message`` (its first line)."""
    kind = type(innermost)
    first = (str(innermost).strip().splitlines() or [""])[0]
    return f"{kind.__module__}.{kind.__qualname__}: {first}" if kind.__module__ != "builtins" else f"{kind.__qualname__}: {first}"


def _usage_error(stop: SystemExit) -> bool:
    """A ``SystemExit(2)`` raised by a command-line parser (argparse, jsonargparse: LightningCLI): a usage error."""
    tb, innermost = stop.__traceback__, None
    while tb is not None:
        innermost, tb = tb.tb_frame.f_code.co_filename, tb.tb_next
    return stop.code == 2 and innermost is not None and ("argparse" in os.path.basename(innermost) or
                                                         "jsonargparse" in innermost)


def run_as_main(script: str, script_args: list[str]) -> None:
    """Run ``script`` in this (forked) interpreter as ``python SCRIPT ARGS`` would; returns on exit 0.

    Raises ``SystemExit`` with the exit code otherwise, having printed what the interpreter would
    print (the traceback, or ``sys.exit("message")``'s message). Exit handlers have run when it
    returns or raises: the caller ends the process with ``os._exit`` and skips module teardown.
    """
    import multiprocessing

    multiprocessing.set_start_method(None, force=True)  # the script may choose its own, as in a fresh python
    script = os.path.abspath(script)
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if not stop.code:
            return  # sys.exit() / sys.exit(0): a normal end (torch's agent waits for a return value)
        if _usage_error(stop):
            raise SystemExit(EXIT_NOT_RETRYABLE) from None  # the parser printed the usage and the error already
        if isinstance(stop.code, int):
            raise
        print(stop.code, file=sys.stderr)  # sys.exit("message"), as the interpreter prints it
        raise SystemExit(1) from None
    except BaseException as error:  # noqa: BLE001 - any uncaught error ends the script, as in `python SCRIPT`
        # Printed here, while stderr still goes to this rank's log (multiprocessing would print
        # it after the redirect ends), through sys.excepthook as the interpreter prints it (torch's
        # process group installs one that prefixes each line with `[rank<N>]:`); then exit 1, or
        # EXIT_NOT_RETRYABLE for an error no restart can mend.
        sys.excepthook(*sys.exc_info())
        if not not_retryable(error):
            raise SystemExit(1) from None
        # Last, the cause in one line: the launcher's report quotes a worker's last exception line (the traceback's
        # own last line already is that line when the error is the cause and its message one line).
        innermost = next(e for e in reversed(_chain(error)) if not_retryable(e))
        if innermost is not error or "\n" in str(error).strip():
            print(_root_configuration_error(innermost), file=sys.stderr)
        raise SystemExit(EXIT_NOT_RETRYABLE) from None
    finally:
        # The script is over: let exit handlers (W&B's final sync, a checkpoint writer's last
        # word) finish even when the agent, stopping the group after another rank failed, sends
        # SIGTERM now. Python's default would die on the spot, and an offline W&B run would lose
        # every record still buffered. The agent SIGKILLs after its grace period (30 s) anyway.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _wait_for_threads()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        # Done: a SIGTERM may end it again (it may now wait for the agent to read its result).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _check_cuda_untouched() -> None:
    """A worker forked after CUDA was initialized cannot use it: say so, and how to avoid it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("lightning run: CUDA was initialized in the preloading forkserver, so this forked worker "
                           "cannot use it; rerun with `lightning run --no-preload ...`.")


def _apply_thread_count() -> None:
    """Apply ``OMP_NUM_THREADS`` as ``import torch`` would have.

    torch reads it once, at import — in the forkserver, before the agent set it for the
    workers (torchrun sets 1 per process when several share a node). Without this, 2 ranks
    on 2 cores ran 2 threads each and trained 6x slower (benchmarks/e2e_ett.py).
    """
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if threads.isdigit() and int(threads) > 0 and torch is not None:
        torch.set_num_threads(int(threads))


def _wait_for_threads() -> None:
    """What the interpreter does before exit handlers: stop thread pools, join non-daemon threads.

    ``threading._shutdown`` is the interpreter's own step (it first tells ``ThreadPoolExecutor``
    workers to stop, then joins): joining threads by hand would wait forever on such pools.
    multiprocessing calls it again after us, which returns at once.
    """
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
