#!/usr/bin/env bash
# The first `make example` on a cold page cache vs a later one: the launch phase (issue #30, point 8).
# Needs root (it drops the page cache). From a clone after `make install`: benchmarks/first_run.sh (~5 min on 2 cores).
# cold_nopyc: also without the package's bytecode, as a first run before `make install` compiled it.
set -u
cd "$(dirname "$0")/.."
one() {  # $1 label, $2 cold|warm, $3 pyc|nopyc
  rm -rf ett_runs
  if [ "$3" = nopyc ]; then find lightning_ett examples -name __pycache__ -type d -exec rm -rf {} +; fi
  sync; if [ "$2" = cold ]; then echo 3 > /proc/sys/vm/drop_caches || { echo "cannot drop the page cache: run as root" >&2; exit 1; }; fi
  local start=$(date +%s.%N)
  if [ "$3" = nopyc ]; then env -u PYTHONDONTWRITEBYTECODE make example > /tmp/ex_$1.txt 2>&1; else make example > /tmp/ex_$1.txt 2>&1; fi
  local end=$(date +%s.%N)
  local run=$(ls -d ett_runs/2*/ | head -1)
  .venv/bin/python - "$run" "$1" "$start" "$end" <<'PY'
import json, sys
run, label, start, end = sys.argv[1:]
s = json.load(open(run + "ett_summary.json"))
print(f"{label}: launch {s['phases']['launch']:.2f} s, import {s['phases']['import']:.2f} s, wall {s['wall_s']:.1f} s, "
      f"ETT {s['ett_percent']:.1f} %, make example {float(end) - float(start):.1f} s")
PY
}
date
one cold_pyc cold pyc
one warm_pyc warm pyc
one cold_nopyc cold nopyc
.venv/bin/python -m compileall -q lightning_ett examples > /dev/null  # back as make install leaves it
date
