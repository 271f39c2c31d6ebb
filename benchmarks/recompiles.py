"""Recompiles over a varying-batch stream, with and without DynamicShapes (torch.compile, inductor).

    .venv/bin/python benchmarks/recompiles.py [--sizes 512,512,300,512,177,64,1000]

Each arm is a fresh process (tests/scripts/compile_job.py: a Lightning job with a compiled MLP,
one step per batch size) with its own empty inductor cache, so both compile cold.
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


def run(arm: str, sizes: str, tmp: Path) -> dict:
    out = tmp / arm
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env.update(PYTHONPATH=str(REPO), TORCHINDUCTOR_CACHE_DIR=str(tmp / f"inductor-{arm}"))
    flags = ["--dynamic-shapes"] if arm == "dynamic_shapes" else []
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "compile_job.py"), "--out", str(out),
                           "--sizes", sizes, *flags], env=env, capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads((out / "compile.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="512,512,300,512,177,64,1000")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = {arm: run(arm, args.sizes, Path(tmp)) for arm in ("plain", "dynamic_shapes")}
    print(f"batch sizes: {args.sizes}")
    for arm, r in rows.items():
        print(f"{arm:<16} recompiles {r['recompiles']:>3}   graphs {r['graphs']:>3}   compile {r['seconds']:6.2f} s")


if __name__ == "__main__":
    main()
