"""What a checkpoint save costs the training loop: ours vs torch.save, Lightning's AsyncCheckpointIO and DCP.

    .venv/bin/python benchmarks/checkpoint_cost.py [--gib 1 4] [--dir /tmp/ett-ckpt-bench]

For each state size, every method runs in its own process (checkpoint_job.py), one after
the other in this one run; each makes a warm-up save and then --saves measured saves
(medians): (a) seconds the training loop is blocked per save, (b) the training time the
save really costs: blocked + the extra step time of the steps that ran while the write was
in flight. Goals: (a) ours <= 5 % of the synchronous torch.save;
(b) ours the lowest of all methods.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from checkpoint_job import METHODS


def measure(method: str, gib: float, root: Path, saves: int) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    out = root.parent / f"{root.name}-{method}.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env["PYTHONPATH"] = str(HERE.parent)
    try:
        proc = subprocess.run([sys.executable, str(HERE / "checkpoint_job.py"), "--method", method, "--gib", str(gib),
                               "--dir", str(root), "--out", str(out), "--saves", str(saves)], env=env, capture_output=True,
                              text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{method} at {gib} GiB failed:\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(root, ignore_errors=True)
        out.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--saves", type=int, default=3, help="measured saves per method (medians are printed)")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary directory)")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ett-ckpt-bench-"))
    for gib in args.gib:
        rows = {m: measure(m, gib, base / f"{gib:g}gib", args.saves) for m in METHODS}
        print(f"\n== {gib:g} GiB of state; medians of {args.saves} saves per method after a warm-up save "
              f"(step without a save: {rows['ours']['step_s'] * 1000:.0f} ms) ==")
        print(f"{'method':<20}{'(a) blocked s':>15}{'slowdown s':>12}{'(b) cost s':>12}{'write s':>10}{'steps in write':>16}")
        for m, r in rows.items():
            print(f"{m:<20}{r['blocked_s']:>15.3f}{r['slowdown_s']:>12.3f}{r['cost_s']:>12.3f}{r['write_s']:>10.2f}"
                  f"{r['steps_during_write']:>16}")
        ours = rows["ours"]
        ratio = ours["blocked_s"] / rows["torch_save"]["blocked_s"]
        ranking = sorted(rows, key=lambda m: rows[m]["cost_s"])
        print(f"(a) ours blocked / torch.save blocked = {ratio:.3f}  (goal <= 0.05)")
        print(f"(b) cost ranking, lowest first: {', '.join(ranking)}  (goal: ours first)")
        print("    (b) of each save, per method: " + "; ".join(
            f"{m} " + "/".join(f"{s['cost_s']:.2f}" for s in rows[m]["saves"]) for m in METHODS))
        print(f"    staging buffers held by ours: {ours['staging_bytes'] / 2**30:.2f} GiB (host RAM; pinned on CUDA)")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
