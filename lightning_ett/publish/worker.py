"""The publisher's own process: reads requests on stdin, publishes, answers on stdout.

``python -m lightning_ett.publish.worker --root DIR [--keep-last-n N]``. One JSON
:class:`~lightning_ett.publish.artifact.PublishRequest` per input line; one JSON answer per line
out (``{"ok": true, ...manifest}`` or ``{"ok": false, "error": ...}``). It exits when stdin
closes, i.e. when the trainer ends it or dies, after finishing the version in progress (a
version is atomic, so even a kill mid-way leaves only a ``.tmp`` directory).

A process, not a thread: reading a checkpoint and serializing a model are CPU and GIL work
that would slow training; here they run at a lower priority with one thread and import
nothing but torch (no Lightning, no CUDA context).

Fault injection for tests: ``LIGHTNING_ETT_FAULT_PUBLISH_CRASH=1`` exits with code 17 on the
first request; ``LIGHTNING_ETT_FAULT_PUBLISH_DELAY_S`` sleeps that long before each publish, and
``LIGHTNING_ETT_FAULT_PUBLISH_WORK_S`` works (CPU-bound) that long before each publish: a large export.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

ENV_FAULT_CRASH = "LIGHTNING_ETT_FAULT_PUBLISH_CRASH"
ENV_FAULT_DELAY = "LIGHTNING_ETT_FAULT_PUBLISH_DELAY_S"
ENV_FAULT_WORK = "LIGHTNING_ETT_FAULT_PUBLISH_WORK_S"
NICENESS = 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lightning_ett.publish.worker")
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--keep-last-n", type=int, default=None)
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process dies")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    try:
        os.nice(NICENESS)  # training keeps the CPU it needs
    except OSError:
        pass
    try:  # if the node runs out of host memory (a whole model in RAM), the kernel takes this process, not a rank
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing but answers on the answer channel

    import torch

    from lightning_ett.publish.artifact import PublishRequest, export, remove_stale

    torch.set_num_threads(1)
    remove_stale(args.root)
    _answer(out, {"ready": True, "pid": os.getpid()})
    last_version = 0  # versions only increase, even if the directory is emptied while this process runs
    held = None  # deltas: the newest version's weights, what the next delta is of
    for line in sys.stdin:
        if not line.strip():
            continue
        if os.environ.get(ENV_FAULT_CRASH) == "1":
            os._exit(17)
        request: PublishRequest | None = None
        try:
            request = PublishRequest.from_json(line)
            request = dataclasses.replace(request, after_version=max(request.after_version, last_version))
            if delay := float(os.environ.get(ENV_FAULT_DELAY, "0") or 0):
                time.sleep(delay)
            _work(float(os.environ.get(ENV_FAULT_WORK, "0") or 0))
            manifest, held = export(request, args.root, args.keep_last_n, held)
            last_version = max(last_version, int(manifest.get("version", 0) or 0))
            _answer(out, {"ok": True, "step": request.step, **manifest})
        except Exception as e:  # noqa: BLE001 - every failure is an answer; the trainer decides
            traceback.print_exc(file=sys.stderr)
            _answer(out, {"ok": False, "step": getattr(request, "step", None), "error": f"{type(e).__name__}: {e}"})
    return 0


def _work(seconds: float) -> None:
    """CPU-bound work for ``seconds`` (fault injection: a publish as slow as a large model's export)."""
    deadline, x = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        x = (x * 31 + 7) % 1000003


def _die_with_parent(parent_pid: int | None) -> None:
    """SIGKILL this process when the trainer dies (Linux): an orphan must not go on writing versions
    while the next attempt's publisher starts. Elsewhere, stdin closing ends it after the version in progress."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the call above
        os._exit(0)


def _answer(out: object, answer: dict) -> None:
    out.write(json.dumps(answer) + "\n")  # type: ignore[attr-defined]
    out.flush()  # type: ignore[attr-defined]


if __name__ == "__main__":
    sys.exit(main())
