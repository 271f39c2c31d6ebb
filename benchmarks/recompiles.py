"""Recompiles over a varying-batch stream, with and without DynamicShapes (torch.compile, inductor).

    .venv/bin/python benchmarks/recompiles.py [--sizes 512,512,300,512,177,64,1000]

Each arm is a fresh process (tests/scripts/compile_job.py: a Lightning job with a compiled MLP,
one step per batch size) with its own empty inductor cache, so every run compiles cold
(an untimed run first builds inductor's precompiled header, which every run then shares). Arms:
plain ``torch.compile``, with DynamicShapes, and plain again (A/A: its compile time's distance
from plain's sizes the noise); ``--rounds`` rounds in ``round_order``; medians (min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.spread import median_range, round_order

ARMS = ("plain", "dynamic_shapes", "plain A/A")


def run(arm: str, sizes: str, tmp: Path) -> dict:
    out = tmp / arm.replace(" ", "_").replace("/", "_")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update(PYTHONPATH=str(REPO), TORCHINDUCTOR_CACHE_DIR=str(out) + "-inductor")
    flags = ["--dynamic-shapes"] if arm == "dynamic_shapes" else []
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "compile_job.py"), "--out", str(out),
                           "--sizes", sizes, *flags], env=env, capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads((out / "compile.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512,512,300,512,177,64,1000")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:  # untimed: inductor's precompiled header in /tmp is built once, here
        run("plain", args.sizes, Path(tmp))
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            for arm in round_order(ARMS, r):
                rows[arm].append(run(arm, args.sizes, Path(tmp)))
                print(f"round {r} {arm}: recompiles {rows[arm][-1]['recompiles']}, compile {rows[arm][-1]['seconds']:.2f} s",
                      flush=True)
    print(f"batch sizes: {args.sizes}; {args.rounds} round(s), medians (min-max)")
    for arm, runs in rows.items():
        print(f"{arm:<16} recompiles {median_range([x['recompiles'] for x in runs], '.0f'):>10}   "
              f"graphs {median_range([x['graphs'] for x in runs], '.0f'):>10}   "
              f"compile {median_range([x['seconds'] for x in runs])} s")
    ratio = [d["seconds"] / p["seconds"] for d, p in zip(rows["dynamic_shapes"], rows["plain"])]
    control = [a["seconds"] / p["seconds"] for a, p in zip(rows["plain A/A"], rows["plain"])]
    print(f"compile s, dynamic_shapes / plain per round: {median_range(ratio, '.3f')}; "
          f"A/A plain again / plain: {median_range(control, '.3f')}")


if __name__ == "__main__":
    main()
