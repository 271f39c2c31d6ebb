"""A/B of ETTStrategy's start-up between two checkouts: did a change to the package slow it?

    .venv/bin/python benchmarks/startup_ab.py ROOT_A ROOT_B [ROOT_A] [--rounds 6] [--tables 150]

Each root is a checkout of this repository (e.g. ``git worktree add --detach /tmp/a REV``); name the
first again for an A/A control (the noise floor). Every arm runs `startup_overlap.py`'s sequential
arm (a fresh 2-rank job under ``lightning run`` of a DLRM with 150 tables: planning takes real time)
with its own root's package, in a rotated order every round (`spread.round_order`). Per arm: fit ->
first step and the sharding_plan phase of the slower rank, medians (min-max), every round, and each
arm's per-round ratio to the first. Not a goal's figure: a regression check.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from benchmarks.spread import median_range, round_order
from lightning_ett.instrument.ledger import read_ledger


def startup_overlap_of(root: Path, name: str) -> ModuleType:
    """``benchmarks/startup_overlap.py`` of ``root``: its jobs run with ``root`` on their PYTHONPATH."""
    spec = importlib.util.spec_from_file_location(name, root / "benchmarks" / "startup_overlap.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("roots", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--tables", type=int, default=150)
    args = parser.parse_args()
    arms = [(f"{i}:{root}", startup_overlap_of(root.resolve(), f"startup_overlap_{i}")) for i, root in enumerate(args.roots)]
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in arms}
    for r in range(args.rounds):
        for i in round_order(list(range(len(arms))), r):
            name, module = arms[i]
            out = Path(tempfile.mkdtemp(prefix="startup_ab_"))
            ranks = module.one_run(out, False, args.tables, "lightning-run")
            plan = max(sum(e["end"] - e["start"] for e in lg.events if e["phase"] == "sharding_plan")
                       for lg in read_ledger(out / "ett"))
            job = max(v["to_first_step"] for v in ranks.values())
            runs[name].append((job, plan))
            print(f"round {r + 1} {name}: fit -> first step {job:.2f} s, sharding_plan {plan:.3f} s", flush=True)
    first = arms[0][0]
    for name, values in runs.items():
        for i, what in enumerate(("fit -> first step", "sharding_plan")):
            xs = [v[i] for v in values]
            ratios = [x / base[i] for x, base in zip(xs, runs[first])]
            print(f"{name}: {what} median {median_range(xs, '.3f')} s; every round {', '.join(f'{x:.3f}' for x in xs)}; "
                  f"/ arm 0 per round median {median_range(ratios, '.3f')}")


if __name__ == "__main__":
    main()
