"""A preloaded interpreter that the tests' ``python SCRIPT`` jobs fork from.

Why: about fifty tests start a job as ``python SCRIPT ARGS``. Each start imported torch,
Lightning and TorchRec again (3-5 s on 2 cores) and tore the interpreter down again (~1 s):
minutes of a suite whose subject is what the jobs do, not how an interpreter starts. This is
``lightning run``'s own mechanism (:mod:`lightning_ett.launch.worker`: ranks forked from a server
that imported :data:`~lightning_ett.launch.worker.PRELOAD` once), with the same function running
the script (:func:`~lightning_ett.launch.worker.run_as_main`), applied to the tests' single starts.

What the child gets is what ``python SCRIPT`` gets: the job's environment (plus what the
imports themselves set where the job did not: inductor's default ``TORCHINDUCTOR_CACHE_DIR``...),
working directory, ``sys.argv``, ``sys.path[0]``, ``__name__ == "__main__"``, stdin from
/dev/null, and the exit code. What a fork cannot give it is a different environment *at import
time* (``torch._dynamo.package`` roots its cache in ``TORCHINDUCTOR_CACHE_DIR`` at import, for
one), so a job whose environment differs from the server's after its imports, anywhere but in
variables read only at run time (:data:`RUN_TIME_PREFIXES`), runs as a real subprocess instead.
Multiprocessing's own forkserver is not used here: tests drive the launcher in-process, which
stops and restarts that one.

``ETT_TESTS_NO_ZYGOTE=1`` runs every job as a real subprocess (to rule the zygote out).

Server: ``python zygote.py SOCKET`` imports the modules, then serves one JSON request per
connection (argv, env, cwd, where stdout and stderr go), answers the child's pid, and once the
child ended its exit code (negative: the signal). It exits when its stdin closes (pytest ended).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: Variables that only the jobs' run time reads (checked: no module of ours reads one at import;
#: W&B is not preloaded; pytest's, such as PYTEST_CURRENT_TEST, no job reads): these may differ
#: between a job and the server.
RUN_TIME_PREFIXES = ("LIGHTNING_ETT_", "WANDB_", "PYTEST_")
DISABLE = "ETT_TESTS_NO_ZYGOTE"


def zygote_can_run(args: tuple[str, ...]) -> bool:
    """``python SCRIPT ...`` only: ``-m``, ``-c`` and interpreter options start as real processes."""
    return bool(args) and args[0].endswith(".py") and os.path.isfile(args[0])


class Zygote:
    """The client side, owned by the test session (``conftest``): the server starts at the first job it can
    serve (a session of ``-m`` calls and in-process tests never pays its imports), and forks each job."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self._dir = tempfile.mkdtemp(prefix="ett-zygote-")
        self.address = os.path.join(self._dir, "socket")
        self._server: subprocess.Popen[bytes] | None = None
        self._ready: bool | None = None
        self._set_by_imports: dict[str, str] = {}

    def serves(self, args: tuple[str, ...], env: dict[str, str]) -> bool:
        """Whether ``python *args`` with ``env`` can be forked from the server without a difference."""
        return zygote_can_run(args) and not self.differences(env)

    def differences(self, env: dict[str, str]) -> list[str]:
        """The variables, other than :data:`RUN_TIME_PREFIXES`, in which ``env`` differs from the server's once
        both ran the imports (which set a variable only where it is not set)."""
        if not self._await_ready():
            return ["(the zygote did not start)"]
        server = {**self.env, **self._set_by_imports}
        job = {**self._set_by_imports, **env}
        return sorted(k for k in set(job) | set(server)
                      if job.get(k) != server.get(k) and not k.startswith(RUN_TIME_PREFIXES))

    def _await_ready(self) -> bool:
        if self._ready is None:
            with open(os.path.join(self._dir, "server.log"), "w") as log:  # (the server holds its own copy)
                self._server = subprocess.Popen([sys.executable, __file__, self.address], env=self.env,
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            assert self._server.stdout is not None
            line = self._server.stdout.readline()  # written once its imports are done and it listens
            try:
                self._set_by_imports = json.loads(line)["set_by_imports"]
                self._ready = True
            except (ValueError, KeyError, TypeError):
                self._ready = False  # it failed: every job starts as a real process (its log is in self._dir)
        return self._ready

    def run(self, args: tuple[str, ...], env: dict[str, str], cwd: Path | None,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """As ``subprocess.run([python, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)``."""
        command = [sys.executable, *args]
        with tempfile.TemporaryDirectory(prefix="job-", dir=self._dir) as io_dir:
            out, err = os.path.join(io_dir, "stdout"), os.path.join(io_dir, "stderr")
            request = {"script": args[0], "args": list(args[1:]), "env": env, "cwd": str(cwd or os.getcwd()),
                       "stdout": out, "stderr": err}
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.address)
                conn.sendall(json.dumps(request).encode() + b"\n")
                reply = conn.makefile("rb")
                pid = int(reply.readline())
                conn.settimeout(timeout)
                try:
                    code = int(reply.readline())
                except TimeoutError:
                    os.kill(pid, signal.SIGKILL)  # what subprocess.run does on a timeout (the server reaps it)
                    raise subprocess.TimeoutExpired(command, timeout, output=_read(out), stderr=_read(err)) from None
                except BaseException:  # pytest-timeout's failure, Ctrl-C: the job must not train on, slowing later tests
                    os.kill(pid, signal.SIGKILL)
                    raise
            return subprocess.CompletedProcess(command, code, _read(out), _read(err))

    def close(self) -> None:
        if self._server is not None and self._server.stdin is not None:
            self._server.stdin.close()  # the server exits on EOF
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def _serve(address: str) -> None:
    import importlib

    from lightning_ett.launch.worker import PRELOAD

    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen()
    sys.stdout.write(json.dumps({"set_by_imports": set_by_imports}) + "\n")
    sys.stdout.flush()
    jobs: dict[int, socket.socket] = {}  # child pid -> the connection waiting for its exit code
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return  # pytest ended
        if listener in readable:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("rb").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in (conn, *jobs.values()):
                    other.close()
                _child(request, set_by_imports)  # never returns
            jobs[pid] = conn
            _answer(conn, pid)
        while jobs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = jobs.pop(pid)
            _answer(conn, os.waitstatus_to_exitcode(status))
            conn.close()


def _answer(conn: socket.socket, number: int) -> None:
    try:
        conn.sendall(f"{number}\n".encode())
    except OSError:
        pass  # the client gave up on this job (its timeout) and closed the connection


def _child(request: dict[str, Any], set_by_imports: dict[str, str]) -> None:
    """Become ``python SCRIPT ARGS`` with the request's environment, directory and output files."""
    code = 1
    try:
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                               (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):
            target = os.open(path, mode, 0o644)
            os.dup2(target, fd)
            os.close(target)
        os.environ.clear()
        os.environ.update({**set_by_imports, **request["env"]})  # as the imports would have set them for this job
        os.chdir(request["cwd"])
        if "numpy" in sys.modules:  # a fresh interpreter seeds numpy's global generator afresh (random reseeds at fork)
            sys.modules["numpy"].random.seed()
        from lightning_ett.launch.worker import run_as_main

        run_as_main(request["script"], request["args"])
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # noqa: BLE001 - our own set-up failed: say why, as a crashed interpreter would
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


if __name__ == "__main__":
    del sys.path[0]  # this file's folder: a job's sys.path is its script's folder, then PYTHONPATH (the repository)
    _serve(sys.argv[1])
