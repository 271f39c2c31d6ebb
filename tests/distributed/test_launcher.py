"""`lightning run` end to end: real torchelastic agents, real gloo ranks, real SIGKILLs."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import LIGHTNING, REPO, SCRIPTS, clean_env, lightning_run, rank_facts

from lightning_ett import summarize_run_dir
from lightning_ett.checkpoint import layout as checkpoint_layout
from lightning_ett.durable.procfs import process_alive
from lightning_ett.instrument.ledger import failed_attempts, read_launcher_records, read_ledger
from tests.distributed.test_async_checkpoint_sharded import assert_equal_trees

JOB = str(SCRIPTS / "ett_job.py")


def test_a_sigkilled_rank_is_restarted_and_the_job_matches_an_uninterrupted_run(tmp_path, uninterrupted_dlrm):
    job = ["--max-steps", "12", "--async-every", "4", "--step-sleep", "0.1"]
    full_ranks, _ = uninterrupted_dlrm  # the same job run without interruption (checkpoints and sleeps change nothing)

    (tmp_path / "out").mkdir()
    proc = lightning_run("--devices", "2", "--max-restarts", "1", "--run-dir", str(tmp_path / "run"), JOB,
                         "--out", str(tmp_path / "out"), *job, "--ckpt-dir", str(tmp_path / "ckpt"), "--ett-from-env",
                         LIGHTNING_ETT_FAULT_KILL="1:9")  # rank 1 dies after step 9 of attempt 0: saves at 4 and 8
    assert proc.returncode == 0, proc.stderr[-4000:]

    s = summarize_run_dir(tmp_path / "run")
    resumed_at = s.attempts[1].first_step
    # The newest checkpoint committed before the kill: step 8, or step 4 on a machine so loaded
    # that step 8's background write had not committed 0.1 s later.
    assert resumed_at in (4, 8), resumed_at
    for a, b in zip(full_ranks, rank_facts(tmp_path / "out"), strict=True):
        assert b["global_step"] == 12
        assert a["losses"][resumed_at:] == b["losses"]  # the second attempt resumed by itself
        assert_equal_trees(a["model"], b["model"])
        assert_equal_trees(a["fused"], b["fused"])

    assert len(s.attempts) == 2 and [a.completed for a in s.attempts] == [False, True]
    assert s.lost_s > 0  # the steps from the resume step to 9 ran twice
    assert "rank 1 killed by SIGKILL (lightning-ett fault injection" in s.attempts[0].failure
    assert s.outcome == "finished"
    assert s.phases["launch"] > 0  # launcher start-up and the restart gap count
    assert abs(sum(s.phases.values()) - s.wall_s) < 1e-6
    launcher = read_launcher_records(tmp_path / "run")
    assert [r["attempt"] for r in launcher if r["kind"] == "attempt"] == [0, 1]
    assert "ETT" in proc.stdout and "attempts" in proc.stdout  # the report, printed at the end
    assert (tmp_path / "run" / "ett_summary.json").is_file() and (tmp_path / "run" / "ett_report.png").is_file()


def test_two_launchers_as_two_nodes_train_the_example_together(tmp_path):
    # One rank per "node", both on this machine, meeting at a localhost rendezvous endpoint.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    common = ["--num-nodes", "2", "--devices", "1", "--main-address", "127.0.0.1", "--main-port", port,
              "--run-dir", str(tmp_path / "run"), "--max-restarts", "0", str(REPO / "examples" / "dlrm_example.py"),
              "fit", "--config", str(REPO / "examples" / "dlrm.yaml"), "--trainer.devices", "1", "--trainer.num_nodes", "2",
              "--trainer.max_steps", "24", "--trainer.val_check_interval", "12", "--trainer.limit_val_batches", "2"]
    nodes = [subprocess.Popen([LIGHTNING, "run", "--node-rank", str(r), *common], cwd=tmp_path, env=clean_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    for node, (_, err) in zip(nodes, outputs):
        assert node.returncode == 0, err[-4000:]
    ledgers = read_ledger(tmp_path / "run")
    assert sorted((lg.attempt, lg.rank) for lg in ledgers) == [(0, 0), (0, 1)]
    assert all(lg.status == "finished" and lg.header["world_size"] == 2 for lg in ledgers)
    hosts = {r["node_rank"] for r in read_launcher_records(tmp_path / "run") if r["kind"] == "launch"}
    assert hosts == {0, 1}
    s = summarize_run_dir(tmp_path / "run")
    assert s.attempts[0].last_step == 23 and s.completed
    assert "ETT" in outputs[0][0]  # node 0 prints the job's report


@pytest.mark.parametrize("start", ["--preload", "--no-preload"])
def test_a_script_that_fails_on_every_attempt_stops_after_max_restarts_and_the_ledger_says_why(tmp_path, start):
    (tmp_path / "out").mkdir()
    flags = [start] if start == "--no-preload" else []
    proc = lightning_run(*flags, "--devices", "2", "--max-restarts", "1", "--run-dir", str(tmp_path / "run"), JOB,
                         "--out", str(tmp_path / "out"), "--max-steps", "12", "--fail-at", "3", "--ett-from-env")
    assert proc.returncode == 1
    assert "gave up after 2 attempt(s) (--max-restarts 1)" in proc.stdout + proc.stderr
    printed = " ".join((proc.stdout + proc.stderr).split())
    assert "2 attempt(s), gave up;" in printed and "running or failed" not in printed  # the report's caption
    s = summarize_run_dir(tmp_path / "run")
    assert [a.attempt for a in s.attempts] == [0, 1] and not any(a.completed for a in s.attempts)
    for attempt in s.attempts:
        assert "RuntimeError: planted bug at step 3" in attempt.failure
    assert s.outcome.startswith("gave up after 2 attempt(s)") and "planted bug" in s.outcome
    # The ranks said it too, in their own ledgers.
    assert all(lg.status == "failed" and "planted bug" in lg.reason for lg in read_ledger(tmp_path / "run"))
    assert json.loads((tmp_path / "run" / "ett_summary.json").read_text())["outcome"] == s.outcome


def test_a_script_that_dies_before_training_still_gets_a_report(tmp_path):
    script = tmp_path / "broken.py"
    script.write_text("raise SystemExit('cannot start: no such dataset')\n")
    proc = lightning_run("--max-restarts", "0", "--run-dir", str(tmp_path / "run"), str(script))
    assert proc.returncode == 1
    s = summarize_run_dir(tmp_path / "run")
    assert s.attempts[0].failure == "rank 0 exit code 1: cannot start: no such dataset"
    assert s.ett_percent == 0 and s.phases["launch"] == s.wall_s > 0


SCRIPT_FACTS = """
import atexit, json, os, sys, threading, time
preloaded = "torch" in sys.modules  # forked from the preloading forkserver, or a fresh python
out = sys.argv[1]
assert sys.argv[3:] == ["--monitor", "--nnodes", "7"], sys.argv  # for the script, not for torchrun
def at_exit():
    with open(os.path.join(out, "atexit.txt"), "w") as f:
        f.write("ran")
atexit.register(at_exit)
def late():
    time.sleep(0.5)
    open(os.path.join(out, "thread.txt"), "w").write("joined")
threading.Thread(target=late).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)  # never shut down: the interpreter stops it at exit, and so must the worker
pool.submit(time.sleep, 0.1)
import helper_next_to_script
import torch
facts = {"name": __name__, "argv": sys.argv, "attempt": os.environ["LIGHTNING_ETT_ATTEMPT"],
         "helper": helper_next_to_script.VALUE, "threads": [os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()],
         "preloaded": preloaded}
open(os.path.join(out, f"facts{os.environ['RANK']}.json"), "w").write(json.dumps(facts))
if __name__ == "__main__":
    sys.exit(None if sys.argv[2] == "none" else int(sys.argv[2]))
"""


@pytest.mark.parametrize("start", ["--preload", "--no-preload"])
def test_a_worker_runs_the_script_as_python_would(tmp_path, start):
    (tmp_path / "job").mkdir()
    script = tmp_path / "job" / "train.py"
    script.write_text(SCRIPT_FACTS)
    (tmp_path / "job" / "helper_next_to_script.py").write_text("VALUE = 42\n")
    flags = [start] if start == "--no-preload" else []
    proc = lightning_run(*flags, "--devices", "2", "--max-restarts", "0", "--run-dir", str(tmp_path / "run"), str(script),
                         str(tmp_path), "0", "--monitor", "--nnodes", "7", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"facts{rank}.json").read_text())
        # torchrun's OMP_NUM_THREADS=1 for 2 processes on a node holds in forked workers too.
        argv = [str(script), str(tmp_path), "0", "--monitor", "--nnodes", "7"]
        assert facts == {"name": "__main__", "argv": argv, "attempt": "0", "helper": 42, "threads": ["1", 1],
                         "preloaded": start == "--preload"}
    assert (tmp_path / "atexit.txt").read_text() == "ran"  # exit handlers ran
    assert (tmp_path / "thread.txt").read_text() == "joined"  # and non-daemon threads finished first
    bare_exit = lightning_run(*flags, "--max-restarts", "0", "--run-dir", str(tmp_path / "run1"), str(script),
                              str(tmp_path), "none", "--monitor", "--nnodes", "7", timeout=120)
    assert bare_exit.returncode == 0, bare_exit.stderr[-3000:]  # sys.exit() is a normal end, not a hang
    failed = lightning_run(*flags, "--devices", "2", "--max-restarts", "0", "--run-dir", str(tmp_path / "run2"), str(script),
                           str(tmp_path), "3", "--monitor", "--nnodes", "7")
    assert failed.returncode == 1  # the job failed: the workers' own exit codes are in the ledger
    failures = [r for r in read_launcher_records(tmp_path / "run2") if r["kind"] == "failure"]
    (root,) = [r for r in failures if r["root_cause"]]
    assert root["exitcode"] == 3 and root["reason"].startswith("exit code 3"), failures
    assert {r["exitcode"] for r in failures} <= {3, -signal.SIGTERM}, failures  # the peer exited too, or was stopped


def signal_a_training_job(tmp_path: Path, sig: signal.Signals, *job_args: str) -> subprocess.Popen[str]:
    """``lightning run`` of the 2-rank job, sent ``sig`` once both ranks trained a few steps; returns it, exited."""
    (tmp_path / "out").mkdir()
    proc = subprocess.Popen([LIGHTNING, "run", "--devices", "2", "--run-dir", str(tmp_path / "run"), JOB, "--out",
                             str(tmp_path / "out"), "--max-steps", "100000", "--step-sleep", "0.05", "--ett-from-env",
                             *job_args], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    # Steps, not seconds: under the hang watch a rank's ledger exists before its start-up (which takes longer than
    # any fixed sleep on a loaded machine), and a signal before step 0 is another case ("before training").
    try:
        _workers_training(tmp_path / "run", proc, steps=3)
    except AssertionError:
        proc.kill()  # (a job of 100000 steps: not left running)
        proc.communicate()
        raise
    proc.send_signal(sig)
    proc.output = proc.communicate(timeout=120)  # type: ignore[attr-defined]
    return proc


def test_a_sigterm_to_the_launcher_stops_the_job_and_the_ledger_says_so(tmp_path):
    proc = signal_a_training_job(tmp_path, signal.SIGTERM)  # what a scheduler sends before it takes the node
    _, err = proc.output
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    (end,) = [r for r in read_launcher_records(tmp_path / "run") if r["kind"] == "end"]
    assert end["reason"].startswith("stopped by SIGTERM at step ")
    assert end["reason"].endswith("no AsyncCheckpoint checkpoint recorded")
    assert summarize_run_dir(tmp_path / "run").outcome == end["reason"]
    assert "stopped by SIGTERM" in err
    assert "forcefully exiting" not in err, err[-3000:]  # the workers stopped on the SIGTERM, not at torch's 30 s SIGKILL


def test_ctrl_c_stops_the_job_as_sigterm_does_with_a_checkpoint_at_the_step_it_stopped(tmp_path):
    # SIGINT is what Ctrl-C sends (to the launcher's process group: the workers lead their own)
    proc = signal_a_training_job(tmp_path, signal.SIGINT, "--ckpt-dir", str(tmp_path / "ckpt"), "--async-every", "100000")
    out, err = proc.output
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    (end,) = [r for r in read_launcher_records(tmp_path / "run") if r["kind"] == "end"]
    stopped = re.fullmatch(r"stopped by the user \(SIGINT\) at step (\d+), checkpoint at step (\d+)", end["reason"])
    assert stopped and stopped[1] == stopped[2], end["reason"]  # saved where it stopped, as on SIGTERM
    newest = checkpoint_layout.newest_complete(tmp_path / "ckpt")
    assert newest is not None and newest.name == f"step-{int(stopped[2]):09d}"
    assert end["reason"] in err and "KeyboardInterrupt" not in out + err, err[-3000:]
    report = " ".join(out.split())
    assert "1 attempt(s), stopped;" in report and "stopped (below)" in report and "SIGTERMException" not in report
    # Relaunched, it resumes where it stopped; the stop stays a stop (not a failure, nor one for the cadence's MTBF)
    step = int(stopped[2])
    again = lightning_run("--devices", "2", "--run-dir", str(tmp_path / "run"), JOB, "--out", str(tmp_path / "out"),
                          "--max-steps", str(step + 6), "--ett-from-env", "--ckpt-dir", str(tmp_path / "ckpt"),
                          "--async-every", "100000")
    assert again.returncode == 0, again.stderr[-3000:]
    first, second = summarize_run_dir(tmp_path / "run").attempts
    assert first.stopped == end["reason"] and first.failure is None and second.first_step == step
    assert failed_attempts(tmp_path / "run", before=2) == 0
    assert "SIGTERMException" not in again.stdout


def test_ctrl_c_with_dataloader_workers_under_no_preload_still_saves_where_it_stopped(tmp_path):
    """torch stops a --no-preload worker with a SIGTERM to its process group, which killed its DataLoader workers
    and the rank mid-step; the launcher signals the rank alone."""
    proc = subprocess.Popen([LIGHTNING, "run", "--no-preload", "--run-dir", str(tmp_path / "run"),
                             str(SCRIPTS / "dataloader_workers_job.py"), str(tmp_path)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not summarize_steps(tmp_path / "run") and time.time() < deadline:
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    stopped = re.search(r"stopped by the user \(SIGINT\) at step (\d+), checkpoint at step (\d+)", err)
    assert stopped and stopped[1] == stopped[2] and "is killed by signal" not in err, err[-3000:]


def summarize_steps(run_dir: Path) -> int:
    """Training steps rank 0 recorded so far (0 before its ledger exists)."""
    return sum(e["phase"] == "train" for lg in read_ledger(run_dir) if lg.rank == 0 for e in lg.events) \
        if (run_dir / "ledger").is_dir() else 0


def test_a_rank_failing_after_another_finished_ends_the_launch_instead_of_hanging_it(tmp_path):
    # Rank 1's script ends and it waits for the agent; rank 0 then fails. torch kills the waiting
    # rank, and setting the release event inline used to block the launcher forever on it.
    started = time.time()
    proc = lightning_run("--devices", "2", "--max-restarts", "0", "--run-dir", str(tmp_path / "run"),
                         str(SCRIPTS / "late_failure_job.py"), timeout=120)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.time() - started < 60
    end = [r for r in read_launcher_records(tmp_path / "run") if r["kind"] == "end"]
    assert end and "rank 0 failed after rank 1 had finished" in end[0]["reason"]


def test_the_forkserver_does_not_outlive_the_launcher(tmp_path):
    # It inherits the launcher's output: an orphan still tearing down held `lightning run | tee` open.
    script = tmp_path / "hello.py"
    script.write_text("print('hello from', __name__)\n")
    proc = subprocess.Popen([LIGHTNING, "run", "--devices", "1", "--max-restarts", "0", "--run-dir", str(tmp_path / "run"),
                             str(script)], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.wait(timeout=120) == 0
    exited = time.time()
    output = proc.stdout.read().decode()  # EOF once every holder of the pipe has exited
    assert time.time() - exited < 0.5
    assert "hello from __main__" in output


# ---------------------------------------------------------------- no orphans, no double writers
def _start_job(logs: Path, *args: str) -> subprocess.Popen:
    """A `lightning run` in its own process group, its output in files (a long job would fill a pipe)."""
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "stdout", "w") as out, open(logs / "stderr", "w") as err:
        return subprocess.Popen([LIGHTNING, "run", *args], env=clean_env(), stdout=out, stderr=err, start_new_session=True)


def _workers_training(run_dir: Path, launcher: subprocess.Popen, steps: int, timeout: float = 120) -> dict[int, int]:
    """Once both ranks of attempt 0 trained ``steps`` steps: each rank's pid (from its ledger header)."""
    deadline = time.time() + timeout
    while time.time() < deadline and launcher.poll() is None:
        ledgers = [lg for lg in read_ledger(run_dir) if lg.attempt == 0] if (run_dir / "ledger").is_dir() else []
        trained = [lg for lg in ledgers if sum(e["phase"] == "train" for e in lg.events) >= steps]
        if len(trained) == 2:
            return {lg.rank: int(lg.header["pid"]) for lg in trained}
        time.sleep(0.2)
    raise AssertionError(f"the job never trained {steps} steps on both ranks (launcher exit code {launcher.poll()})")


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _sigkill_and_expect_gone(launcher: subprocess.Popen, pids: set[int], within_s: float = 10) -> float:
    """``kill -9`` the launcher; returns how long its job's processes took to die (fails past ``within_s``)."""
    launcher.kill()
    launcher.wait()
    killed = time.time()
    while time.time() - killed < within_s and any(process_alive(pid) for pid in pids):
        time.sleep(0.1)
    alive = sorted(pid for pid in pids if process_alive(pid))
    assert not alive, f"alive {within_s} s after the launcher's SIGKILL: {alive}"
    return time.time() - killed


def _kill_all(launcher: subprocess.Popen, pids: set[int]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(launcher.pid, signal.SIGKILL)
    for pid in pids:  # torch starts --no-preload workers in sessions of their own
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    launcher.wait()


def test_a_sigkilled_launcher_takes_its_no_preload_workers_with_it(tmp_path):
    # (With --preload, the forkserver and its workers: the next test.)
    launcher = _start_job(tmp_path / "logs", "--no-preload", "--devices", "2", "--max-restarts", "0", "--run-dir",
                          str(tmp_path / "run"), JOB, "--out", str(tmp_path), "--max-steps", "100000", "--step-sleep",
                          "0.05", "--ett-from-env")
    pids: set[int] = set()
    try:
        pids = set(_workers_training(tmp_path / "run", launcher, steps=3).values())
        assert {_parent(pid) for pid in pids} == {launcher.pid}  # torch's subprocesses
        _sigkill_and_expect_gone(launcher, pids)
    finally:
        _kill_all(launcher, pids)


def test_a_live_jobs_run_dir_and_checkpoint_dir_are_refused_to_others_until_it_is_sigkilled(tmp_path):
    run, other, ckpt, out = tmp_path / "run", tmp_path / "other", tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    hello = tmp_path / "hello.py"
    hello.write_text("print('hello')\n")
    host = socket.gethostname()
    first = _start_job(tmp_path / "first", "--devices", "2", "--max-restarts", "0", "--run-dir", str(run), JOB, "--out",
                       str(out), "--max-steps", "100000", "--step-sleep", "0.05", "--async-every", "5", "--ckpt-dir",
                       str(ckpt), "--ett-from-env")
    pids: set[int] = set()
    try:
        workers = _workers_training(run, first, steps=6)
        forkserver = _parent(workers[0])
        pids = {*workers.values(), forkserver}
        assert forkserver != first.pid and _parent(forkserver) == first.pid

        # A second launcher into the live job's run directory: refused at once, naming the owner.
        started = time.time()
        second = lightning_run("--run-dir", str(run), str(hello), timeout=60)
        assert second.returncode == 2, second.stderr[-3000:]
        assert time.time() - started < 15
        assert f"--run-dir {str(run)!r} (node 0) is in use by job 'run' (pid {first.pid} on host {host!r}" in second.stderr
        assert "hello" not in second.stdout
        assert [r["kind"] for r in read_launcher_records(run)].count("launch") == 1  # it recorded nothing

        # Another job writing the same checkpoint directory: fails on every rank before its first step, and is not
        # restarted (a directory a live job owns fails the same way on every attempt).
        job = [JOB, "--out", str(out), "--async-every", "2", "--ckpt-dir", str(ckpt), "--ett-from-env"]
        third = lightning_run("--devices", "2", "--max-restarts", "2", "--run-dir", str(other), *job, "--max-steps", "4")
        assert third.returncode == 1
        assert [r["attempt"] for r in read_launcher_records(other) if r["kind"] == "attempt"] == [0]
        assert "not retried" in third.stderr
        ledgers = read_ledger(other)
        assert sorted(lg.rank for lg in ledgers) == [0, 1]
        for lg in ledgers:
            assert not [e for e in lg.events if e["phase"] == "train"]
            assert lg.status == "failed" and "DirectoryInUseError" in lg.reason, lg.reason
            assert f"AsyncCheckpoint(dirpath={str(ckpt)!r}) is in use by job 'run'" in lg.reason
            assert f"pid {workers[0]} on host {host!r}, attempt 0" in lg.reason  # rank 0 of the first job

        # kill -9 of the first launcher: its forkserver and workers follow it within seconds.
        _sigkill_and_expect_gone(first, pids)

        # Both directories are taken over once their owner is dead.
        fourth = lightning_run("--run-dir", str(run), str(hello), timeout=120)
        assert fourth.returncode == 0, fourth.stderr[-3000:]
        assert "hello" in fourth.stdout
        assert f"lightning run: warning: --run-dir {str(run)!r} (node 0): taking over from job 'run' (pid {first.pid}" \
            in fourth.stderr
        newest = checkpoint_layout.newest_complete(ckpt)
        assert newest is not None
        steps = str(int(newest.name.split("-")[1]) + 2)
        fifth = lightning_run("--devices", "2", "--max-restarts", "0", "--run-dir", str(other), *job, "--max-steps", steps)
        assert fifth.returncode == 0, fifth.stderr[-3000:]
        assert f"taking over from job 'run' (pid {workers[0]} on host {host!r}, attempt 0" in fifth.stderr
        assert f"this job resumes from the newest complete one here (at most {newest.name})" in fifth.stderr
        assert not (ckpt / ".ett-owner").exists() and not list(run.glob(".ett-owner*"))  # released at the end
    finally:
        _kill_all(first, pids)
