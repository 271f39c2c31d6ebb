"""The tests' zygote (helpers/zygote.py) gives a forked job what `python SCRIPT` gives it, and starts the rest as processes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import clean_env, session_zygote

PROBE = """
import json, os, sys, threading, atexit, time
import numpy as np
import helper_next_to_script
facts = {"name": __name__, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "stdin": sys.stdin.read(),
         "env": os.environ.get("LIGHTNING_ETT_PROBE"), "helper": helper_next_to_script.VALUE, "draw": float(np.random.rand())}
print(json.dumps(facts))
atexit.register(lambda: print("atexit ran"))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", file=sys.stderr))).start()
if sys.argv[1] == "raise":  # through sys.excepthook, as torch's process group prints `[rank<N>]: ...`
    sys.excepthook = lambda kind, value, tb: print(f"hooked: {kind.__name__}: {value}", file=sys.stderr)
    raise ValueError("the probe failed")
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(None if sys.argv[1] == "none" else sys.argv[1] if not sys.argv[1].isdigit() else int(sys.argv[1]))
"""


@pytest.fixture
def probe(tmp_path):
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "helper_next_to_script.py").write_text("VALUE = 42\n")
    (tmp_path / "job" / "probe.py").write_text(PROBE)
    (tmp_path / "cwd").mkdir()
    return str(tmp_path / "job" / "probe.py"), tmp_path / "cwd"


def both(script: str, cwd, *args: str) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    env = clean_env(LIGHTNING_ETT_PROBE="set for this job")
    zygote = session_zygote()
    assert zygote.serves((script, *args), env), zygote.differences(env)
    forked = zygote.run((script, *args), env, cwd, timeout=60)
    real = subprocess.run([sys.executable, script, *args], check=False, env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=60)
    return forked, real


@pytest.mark.parametrize("exit_with", ["none", "0", "3", "a message", "raise"])
def test_a_forked_job_sees_and_ends_as_under_python(probe, exit_with):
    script, cwd = probe
    forked, real = both(script, cwd, exit_with)
    assert forked.returncode == real.returncode == {"none": 0, "0": 0, "3": 3}.get(exit_with, 1)
    facts, real_facts = (json.loads(p.stdout.splitlines()[0]) for p in (forked, real))
    assert facts.pop("draw") != real_facts.pop("draw")  # numpy's global generator is seeded afresh
    assert facts == real_facts == {"name": "__main__", "argv": [script, exit_with], "path0": str(cwd.parent / "job"),
                                   "cwd": str(cwd), "stdin": "", "env": "set for this job", "helper": 42}
    for proc in (forked, real):
        assert proc.stdout.splitlines()[-1] == "atexit ran" and "thread joined" in proc.stderr
    if exit_with == "a message":
        assert "a message" in forked.stderr.splitlines() and "a message" in real.stderr.splitlines()
    if exit_with == "raise":
        assert "hooked: ValueError: the probe failed" in forked.stderr.splitlines()
        assert "hooked: ValueError: the probe failed" in real.stderr.splitlines()


def test_a_job_past_its_timeout_is_killed_as_subprocess_run_kills_it(probe):
    script, cwd = probe
    zygote = session_zygote()
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        zygote.run((script, "sleep"), clean_env(), cwd, timeout=3)
    assert '"name": "__main__"' in expired.value.stdout  # what it printed before it was killed comes back
    again = zygote.run((script, "0"), clean_env(), cwd, timeout=60)  # and the server serves the next job
    assert again.returncode == 0


def test_what_a_fork_cannot_give_starts_as_a_real_process(probe):
    script, _ = probe
    zygote = session_zygote()
    assert zygote.serves((script,), clean_env(WANDB_MODE="disabled", LIGHTNING_ETT_FAULT_KILL="1"))  # read at run time
    assert not zygote.serves((script,), clean_env(TORCHINDUCTOR_CACHE_DIR="/tmp/x"))  # read by torch at import
    unset = {k: v for k, v in clean_env().items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    assert zygote.serves((script,), unset)  # unset, the imports set inductor's default: as in the server
    assert not zygote.serves((script,), clean_env(OMP_NUM_THREADS="1"))
    assert not zygote.serves(("-c", "print(1)"), clean_env())
    assert not zygote.serves(("-m", "lightning_ett.launch.cli"), clean_env())
