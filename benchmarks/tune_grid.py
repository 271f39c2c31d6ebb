"""Measure a tune benchmark grid: every configuration of a space run as a real ``tune`` trial, R times.

    .venv/bin/python benchmarks/tune_grid.py --grid user [--repeats 2] [--steps 60]

Each run is exactly a ``lightning-ett tune`` trial (:class:`lightning_ett.tune.trials.TrialRunner`:
``lightning run`` of the grid's script on 2 gloo ranks, measured from its ledger by
:func:`lightning_ett.tune.measure.measure`), and every measurement is stored, not only the
throughput, so any objective can be computed from the grid afterwards. Repeat r runs the
configurations in an order shuffled with seed r, so the VM's drift falls on different
configurations in each repeat. The file (``benchmarks/data/tune_grid_<grid>.json``) is rewritten
after every run; run the command again to continue an interrupted measurement.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
from lightning_ett.durable.files import atomic_write_text
from lightning_ett.tune.space import Space, key
from lightning_ett.tune.trials import TrialRunner


@dataclass(frozen=True)
class Grid:
    name: str
    script: Path
    config: Path
    space: Path

    @property
    def data(self) -> Path:
        return HERE / "data" / ("tune_grid.json" if self.name == "dlrm" else f"tune_grid_{self.name}.json")


GRIDS = {
    # the grid the search design was chosen on (measured once per configuration, 2026-12-03)
    "dlrm": Grid("dlrm", REPO / "examples" / "dlrm_example.py", HERE / "tune_dlrm.yaml", HERE / "tune_space.yaml"),
    # the held-out grid: measured after the design was fixed, nothing designed on it
    "user": Grid("user", HERE / "tune_user_job.py", HERE / "tune_user.yaml", HERE / "tune_user_space.yaml"),
}


def runs_of(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """A grid entry's runs (the first grid stored one run per configuration, flat)."""
    if "runs" in entry:
        return entry["runs"]
    return [{"failed": entry["failed"], "ok": entry["failed"] is None,
             **{k: entry.get(k) for k in ("throughput", "step_s", "startup_s", "seconds")}}]


def measure(grid: Grid, repeats: int, steps: int) -> dict[str, Any]:
    space = Space.load(grid.space)
    stored = json.loads(grid.data.read_text()) if grid.data.exists() else None
    if stored is None or stored.get("steps") != steps or stored.get("space") != space.options:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=False).stdout
        stored = {"date": time.strftime("%Y-%m-%d"), "commit": commit.strip(), "steps": steps, "devices": 2,
                  "script": str(grid.script.relative_to(REPO)), "config": str(grid.config.relative_to(REPO)),
                  "space": space.options, "grid": {}}
    stored["repeats"] = repeats
    stored["grid"] = {k: {"config": e["config"], "runs": runs_of(e)} for k, e in stored["grid"].items()}
    every = list(space.configurations())
    with tempfile.TemporaryDirectory(prefix=f"ett-tune-grid-{grid.name}-") as tmp:
        runner = TrialRunner(grid.script, ["fit", "--config", str(grid.config),
                                           "--trainer.callbacks+=lightning_ett.ETTMonitor"], steps, 2, Path(tmp))
        for repeat in range(repeats):
            order = list(every)
            random.Random(repeat).shuffle(order)
            for i, config in enumerate(order):
                entry = stored["grid"].setdefault(key(config), {"config": config, "runs": []})
                if len(runs_of(entry)) > repeat:
                    continue
                reason, measurements, seconds, _ = runner(i, config)
                measurements.pop("phases", None)
                entry["runs"].append({**measurements, "failed": reason, "seconds": seconds})
                atomic_write_text(grid.data, json.dumps(stored, indent=1) + "\n")
                shown = f"{measurements['throughput']:.0f} samples/s" if reason is None else f"failed: {reason}"
                print(f"repeat {repeat + 1}/{repeats}, {i + 1}/{len(order)}: {config} -> {shown} ({seconds:.0f} s)",
                      flush=True)
    return stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grid", choices=sorted(GRIDS), required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60, help="training steps per run")
    args = parser.parse_args()
    grid = GRIDS[args.grid]
    grid.data.parent.mkdir(exist_ok=True)
    measure(grid, args.repeats, args.steps)


if __name__ == "__main__":
    main()
