"""Where AsyncCheckpoint's background write spends its time, against DCP's ``DefaultStager`` (a diagnostic).

    .venv/bin/python benchmarks/checkpoint_writer_phases.py [--model embedding] [--gib 1] [--rounds 6] [--saves 5]

Why: on 2026-12-07 (checkpoint_cost.py at 0a95ae2) ours cost more per save than DCP's
``async_save`` with its ``DefaultStager`` on the ``embedding`` model (0.643 s vs 0.485 s), and
our write lasted longer (1.45 s vs 1.01 s). Our writer does two things DCP does not: the CRC-32
of every file as it is written (the manifest's, checked on resume; torch.save's own zip CRC is
skipped in our writer threads instead) and a page-cache drop after each file's fsync. This runs,
in the same jobs and measurement as checkpoint_cost.py (checkpoint_job.py):

* ``dcp_async_stager`` and its A/A repeat (the noise floor);
* ``ours`` as checkpoint_cost.py runs it, and ``ours timed``: the same, with the writer's phases
  timed (per save, wall and the writer thread's CPU; the warm-up save left out);
* ``ours no-crc`` and ``ours no-drop``: timed counterfactuals that skip one of the two (the
  manifest then holds CRC 0; timing only, never a setting of the product).

Per round the arms' order comes from ``round_order`` (6 rounds: each arm in each position once);
per job the median save; reported: the median over rounds (min-max), each arm's cost per round
÷ the stager's and ÷ plain ``ours``, the phases, and every run. The timers are monkeypatched
module attributes (the writer looks each up at call time); a diagnostic, so no hook in the package.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SWITCHES = ("timed", "no-crc", "no-drop")


class _Saves:
    """Seconds per phase of each save (wall, and the writer thread's CPU), closed when the save's ``_write`` returns."""

    def __init__(self) -> None:
        self.done: list[dict[str, list[float]]] = []
        self.current: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
        self.reading_back = threading.local()  # inside crc32_of: a file read back, not summed as written

    def add(self, phase: str, wall: float, cpu: float) -> None:
        cell = self.current[phase]
        cell[0] += wall
        cell[1] += cpu

    def close(self) -> None:
        self.done.append(dict(self.current))
        self.current = collections.defaultdict(lambda: [0.0, 0.0])


_saves = _Saves()


def _timed(name: str, fn: Callable[..., Any], closes_save: bool = False) -> Callable[..., Any]:
    """``fn``, adding each call's wall and calling thread's CPU seconds to the save's ``name``."""

    def timed(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            _saves.add(name, time.perf_counter() - wall, time.thread_time() - cpu)
            if closes_save:
                _saves.close()

    return timed


def _read_back(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``crc32_of``, its CRC time counted as read back (files not summed as written: lightning.pt, .metadata)."""

    def reading(*args: Any, **kwargs: Any) -> Any:
        _saves.reading_back.on = True
        try:
            return fn(*args, **kwargs)
        finally:
            _saves.reading_back.on = False

    return reading


class _Crc32:
    """Stands in for the ``zlib`` module in ``durable.manifest``: times its ``crc32`` (or skips it: ``no-crc``)."""

    def __init__(self, skip: bool) -> None:
        self.skip = skip

    def crc32(self, data: Any, value: int = 0) -> int:
        if self.skip:
            return 0
        t = time.perf_counter()
        try:
            return zlib.crc32(data, value)
        finally:
            back = getattr(_saves.reading_back, "on", False)
            _saves.add("crc32_read_back" if back else "crc32_as_written", time.perf_counter() - t, 0.0)


def install(switch: str) -> None:
    """Time the writer's phases in this process (checkpoint_job.py ``--phases``); ``switch`` skips one of them.

    ``no-drop`` skips the drop after each DCP file (``dcp_io.drop_from_cache``), not the one after a
    read-back checksum (``crc32_of(drop_cache=True)``: lightning.pt and ``.metadata``, small files).
    """
    from lightning_ett.checkpoint import dcp_io, staging, writer
    from lightning_ett.checkpoint import layout as fmt
    from lightning_ett.durable import manifest

    manifest.zlib = _Crc32(skip=switch == "no-crc")  # type: ignore[assignment]
    manifest.crc32_of = _read_back(manifest.crc32_of)
    dcp_io.drop_from_cache = (lambda path: None) if switch == "no-drop" else _timed("drop", dcp_io.drop_from_cache)
    dcp_io.write = _timed("dcp_write", dcp_io.write)
    staging.Snapshot.copy_late = _timed("copy_late", staging.Snapshot.copy_late)  # type: ignore[method-assign]
    staging.Snapshot.wait_copied = _timed("copy_late", staging.Snapshot.wait_copied)  # type: ignore[method-assign]
    fmt.commit_checkpoint = _timed("commit", fmt.commit_checkpoint)
    writer.retire = _timed("retire", writer.retire)  # retention: deleting the previous checkpoint
    writer.CheckpointWriter._write = _timed("whole_write", writer.CheckpointWriter._write,  # type: ignore[method-assign]
                                            closes_save=True)


def report() -> list[dict[str, list[float]]]:
    """Per save, in order (the warm-up save first): phase -> [wall s, writer-thread CPU s]."""
    return _saves.done


ARMS = ("dcp_async_stager", "dcp_async_stager A/A", "ours", "ours timed", "ours no-crc", "ours no-drop")
# Nested: whole_write holds the rest; dcp_write holds crc32_as_written and drop; commit holds crc32_read_back (retire
# runs after the commit, inside whole_write). crc32_* are wall seconds only (the CRC's CPU is inside its caller's).
PHASES = ("whole_write", "copy_late", "dcp_write", "crc32_as_written", "drop", "commit", "crc32_read_back", "retire")


def _phase_medians(run: dict) -> dict[str, tuple[float, float]]:
    """Per phase, the median over the measured saves (the warm-up save dropped) of (wall s, CPU s); 0 where absent."""
    if len(run["phases"]) != len(run["saves"]) + 1:  # a voided snapshot is written again: the warm-up is not [0]
        print(f"  (a job wrote {len(run['phases'])} saves for {len(run['saves'])} measured: its phases are left out)")
        return {}
    saves = run["phases"][1:]
    return {phase: (statistics.median(s.get(phase, [0.0, 0.0])[0] for s in saves),
                    statistics.median(s.get(phase, [0.0, 0.0])[1] for s in saves)) for phase in PHASES} if saves else {}


def main() -> None:
    from checkpoint_cost import measure
    from spread import aa_floor, against_floor, median_range, round_order

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("embedding", "ett"), default="embedding")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=6, help="6: each arm in each position once (round_order)")
    parser.add_argument("--saves", type=int, default=5)
    args = parser.parse_args()
    base_dir = Path(tempfile.mkdtemp(prefix="ett-writer-phases-"))
    runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    try:
        for r in range(args.rounds):
            order = round_order(list(ARMS), r)
            for arm in order:
                method, _, variant = arm.partition(" ")
                extra = ["--phases", variant] if variant in SWITCHES else []
                runs[arm].append(measure(args.model, method, args.gib, base_dir / "ckpt", args.saves, extra=extra))
            print(f"  round {r + 1}: " + ", ".join(f"{a} {runs[a][-1]['cost_s']:.3f}" for a in order), flush=True)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    print(f"\n== {args.model}, {args.gib:g} GiB, {args.rounds} rounds x {args.saves} measured saves; cost and write: "
          f"each job's median save, then median (min-max) over rounds ==")

    def per_round(arm: str, ref: str) -> list[float]:
        return [x["cost_s"] / b["cost_s"] for x, b in zip(runs[arm], runs[ref])]

    floor = aa_floor(per_round("dcp_async_stager A/A", "dcp_async_stager"))
    for arm in ARMS:
        print(f"{arm:<22} cost {median_range([x['cost_s'] for x in runs[arm]], '.3f'):<22} "
              f"write {median_range([x['write_s'] for x in runs[arm]], '.2f'):<18} "
              f"÷ stager {median_range(per_round(arm, 'dcp_async_stager'), '.3f')}"
              + ("" if arm.startswith("dcp") else f" ({against_floor(per_round(arm, 'dcp_async_stager'), floor)})"))
    for arm in ARMS[3:]:
        print(f"{arm} ÷ ours, per round: {median_range(per_round(arm, 'ours'), '.3f')} "
              f"({against_floor(per_round(arm, 'ours'), floor)})")
    print(f"A/A floor (the stager against its repeat): ±{floor:.3f}")
    print("writer phases per measured save, wall s / writer-thread CPU s (median over saves, then over rounds); nested: "
          "whole_write holds the rest, dcp_write holds crc32_as_written and drop, commit holds crc32_read_back; crc32_* "
          "wall only")
    for arm in ARMS[3:]:
        medians = [m for m in (_phase_medians(run) for run in runs[arm]) if m]
        if not medians:
            continue
        cells = [f"{phase} {statistics.median(m[phase][0] for m in medians):.3f}"
                 + ("" if phase.startswith("crc32") else f"/{statistics.median(m[phase][1] for m in medians):.3f}")
                 for phase in PHASES]
        print(f"  {arm:<14} " + ", ".join(cells))
    print("every run's per-save cost (s): " + "; ".join(
        f"{arm} " + " | ".join("/".join(f"{s['cost_s']:.2f}" for s in run["saves"]) for run in runs[arm]) for arm in ARMS))


if __name__ == "__main__":
    main()
