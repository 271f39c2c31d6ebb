"""What a checkpoint save costs the training loop: ours vs torch.save, Lightning's AsyncCheckpointIO and DCP.

    .venv/bin/python benchmarks/checkpoint_cost.py [--gib 1 4] [--saves 5] [--dir /tmp/ett-ckpt-bench]

For each state size, every method runs in its own process (checkpoint_job.py), one after
the other in this one run; each makes a warm-up save and then --saves measured saves
(medians): (a) seconds the training loop is blocked per save, (b) the training time the
save really costs: blocked + the extra step time of the steps that ran while the write was
in flight. Goals: (a) ours <= 5 % of the synchronous torch.save;
(b) ours the lowest of all methods.

The machine is stated first: its memory-copy bandwidth (one large ``copy_``, what staging a
snapshot costs) and its disk-write bandwidth, so a slow machine can be told from a slow design.
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


def copy_bandwidth(gib: float = 1.0, rounds: int = 5) -> tuple[float, float]:
    """GB/s of one large ``dst.copy_(src)`` between two touched buffers (median, min over rounds)."""
    import statistics
    import time

    import torch

    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.zeros_like(src)
    rates = []
    for _ in range(rounds):
        t = time.perf_counter()
        dst.copy_(src)
        rates.append(src.numel() * 4 / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates), min(rates)


def disk_bandwidth(root: Path, mib: int = 512) -> float:
    """MB/s of writing ``mib`` MiB and fsyncing it where the checkpoints go."""
    import time

    block = os.urandom(2**20)
    path = root / "bandwidth.probe"
    t = time.perf_counter()
    with open(path, "wb") as f:
        f.writelines(block for _ in range(mib))
        f.flush()
        os.fsync(f.fileno())
    rate = mib * 2**20 / (time.perf_counter() - t) / 1e6
    path.unlink()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--saves", type=int, default=5, help="measured saves per method (medians are printed)")
    parser.add_argument("--dir", default=None, help="where the checkpoints are written (default: a temporary directory)")
    args = parser.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ett-ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    median_bw, low_bw = copy_bandwidth()
    print(f"machine: {os.cpu_count()} CPUs; memory copy (1 GiB copy_, 5 rounds) {median_bw:.1f} GB/s median, "
          f"{low_bw:.1f} GB/s slowest; disk write + fsync {disk_bandwidth(base):.0f} MB/s ({base})")
    for gib in args.gib:
        rows = {m: measure(m, gib, base / f"{gib:g}gib", args.saves) for m in METHODS}
        print(f"\n== {gib:g} GiB of state; medians of {args.saves} saves per method after a warm-up save "
              f"(step without a save: {rows['ours']['step_s'] * 1000:.0f} ms) ==")
        print(f"{'method':<20}{'(a) blocked s':>15}{'at boundary':>13}{'in next step':>14}{'slowdown s':>12}"
              f"{'(b) cost s':>12}{'write s':>10}{'steps in write':>16}")
        for m, r in rows.items():
            print(f"{m:<20}{r['blocked_s']:>15.3f}{r['boundary_s']:>13.3f}{r['waited_s']:>14.3f}{r['slowdown_s']:>12.3f}"
                  f"{r['cost_s']:>12.3f}{r['write_s']:>10.2f}{r['steps_during_write']:>16}")
        ours = rows["ours"]
        ratio = ours["blocked_s"] / rows["torch_save"]["blocked_s"]
        ranking = sorted(rows, key=lambda m: rows[m]["cost_s"])
        print(f"(a) ours blocked / torch.save blocked = {ratio:.3f}  (goal <= 0.05)")
        print(f"    ours blocked / reused DCP stager blocked = {ours['blocked_s'] / rows['dcp_async_stager']['blocked_s']:.2f} "
              f"(thread), {ours['blocked_s'] / rows['dcp_async_process']['blocked_s']:.2f} (process)")
        print(f"(b) cost ranking, lowest first: {', '.join(ranking)}  (goal: ours first)")
        print("    (b) of each save, per method: " + "; ".join(
            f"{m} " + "/".join(f"{s['cost_s']:.2f}" for s in rows[m]["saves"]) for m in METHODS))
        print(f"    staging buffers held by ours: {ours['staging_bytes'] / 2**30:.2f} GiB (host RAM; pinned on CUDA)")
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
