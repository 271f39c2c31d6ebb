"""The trainer's handle on the publisher process: start it, hand it work, collect its answers.

Everything here is non-blocking for the training thread except :meth:`PublisherProcess.wait_idle`
(used at the end of ``fit``). Answers are read by a daemon thread into a queue; a process that
died is noticed at the next poll and answered for with an error (it is started again on the
next request), so a crashed publisher never stops training.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from lightning_ett.publish.artifact import PublishRequest


class PublisherProcess:
    """One ``python -m lightning_ett.publish.worker`` at a time, at most one request in flight."""

    def __init__(self, root: Path, keep_last_n: int | None) -> None:
        self.root = root
        self.keep_last_n = keep_last_n
        self._proc: subprocess.Popen[str] | None = None
        self._answers: queue.Queue[dict[str, Any]] = queue.Queue()
        self.in_flight: PublishRequest | None = None
        self.exit_codes: list[int] = []

    def start(self) -> None:
        """Start the process now (it imports torch meanwhile, off the training thread's clock)."""
        if self._proc is not None and self._proc.poll() is None:
            return
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ""  # the export runs on the CPU; never a CUDA context on a training GPU
        env["PYTHONUNBUFFERED"] = "1"
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID"):
            env.pop(key, None)  # not a rank of the job
        argv = [sys.executable, "-m", "lightning_ett.publish.worker", "--root", str(self.root),
                "--parent-pid", str(os.getpid())]
        if self.keep_last_n is not None:
            argv += ["--keep-last-n", str(self.keep_last_n)]
        self._proc = proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                             bufsize=1, start_new_session=True)
        assert proc.stdout is not None
        threading.Thread(target=self._read, args=(proc, proc.stdout), name="ett-publisher-answers", daemon=True).start()

    def _read(self, proc: subprocess.Popen[str], stdout: IO[str]) -> None:
        for line in stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                continue
            if isinstance(answer, dict) and not answer.get("ready"):
                self._answers.put(answer)
        self._answers.put({"exited": proc.wait(), "proc": proc})

    def send(self, request: PublishRequest) -> None:
        """Hand ``request`` to the process (starting one if needed). Raises ``OSError`` if it cannot."""
        assert self.in_flight is None, "at most one publish in flight"
        self.start()
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(request.to_json() + "\n")
        self._proc.stdin.flush()
        self.in_flight = request

    def poll(self) -> list[dict[str, Any]]:
        """Answers that arrived since the last poll; a process death answers for the request it held."""
        answers = []
        while True:
            try:
                answer = self._answers.get_nowait()
            except queue.Empty:
                return answers
            if "exited" in answer:
                code = int(answer["exited"])
                if answer["proc"] is not self._proc:
                    continue  # one we stopped, or one that died before the current one was started
                self.exit_codes.append(code)
                if self.in_flight is not None:
                    answers.append({"ok": False, "step": self.in_flight.step, "request_source": self.in_flight.source,
                                    "error": f"the publisher process exited with code {code} while publishing"})
                    self.in_flight = None
                continue
            if self.in_flight is not None:  # one request at a time: this answers it, whatever it says
                answer["request_source"] = self.in_flight.source
                if answer.get("step") is None:
                    answer["step"] = self.in_flight.step
                self.in_flight = None
            answers.append(answer)

    def wait_idle(self, timeout: float) -> list[dict[str, Any]]:
        """Block until the request in flight is answered (or ``timeout``); returns the answers."""
        deadline = time.monotonic() + timeout
        answers = self.poll()
        while self.in_flight is not None and time.monotonic() < deadline:
            time.sleep(0.02)
            answers += self.poll()
        return answers

    def stop(self, timeout: float = 10.0) -> None:
        """Close its input (it finishes the version in progress and exits); kill it after ``timeout``.

        ``timeout=0`` kills it at once (after a training error: a version it leaves half-written
        is a ``.tmp`` directory, never selected, removed by the next publisher).
        """
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.stdin is not None:
                proc.stdin.close()
            if timeout <= 0:
                raise subprocess.TimeoutExpired(proc.args, 0)
            proc.wait(timeout=timeout)
        except (OSError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
