"""`lightning run` / `lightning-ett run`: argument checks, failure reasons, attempt numbering, fault switch."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import LIGHTNING, SCRIPTS, clean_env, launch, run_script

from lightning_ett import summarize_run_dir
from lightning_ett.instrument.ledger import LedgerWriter, launcher_ledger_path, ledger_path
from lightning_ett.launch.cli import main
from lightning_ett.launch.launcher import failure_reason, next_attempt, torchrun_argv
from lightning_ett.lifecycle import faults as faults_module
from lightning_ett.lifecycle.faults import KillFault, RandomFailures, maybe_kill, parse_kill_faults, random_failures_from_env


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hello')\n")
    return path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--devices", "0"], "argument --devices/--nproc-per-node/--nproc_per_node: expected an integer >= 1 or 'auto'"),
        (["--nproc-per-node", "two"], "expected an integer >= 1 or 'auto', got 'two'"),
        (["--num-nodes", "0"], "argument --num-nodes/--num_nodes/--nnodes: expected an integer >= 1"),
        (["--max-restarts", "-1"], "argument --max-restarts/--max_restarts: expected an integer >= 0"),
        (["--main-port", "70000"], "argument --main-port/--main_port/--master-port: expected a TCP port 1-65535"),
    ],
)
def test_bad_option_values_are_rejected_naming_the_option(argv, message, script, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["run", *argv, str(script)])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-nodes", "2", "--node-rank", "2"], "--node-rank 2 is out of range for --num-nodes 2 (expected 0..1)"),
        (["--num-nodes", "2", "--main-address", "n0"], "pass the same --run-dir (on shared storage) or --job-id"),
        (["--num-nodes", "2", "--run-dir", "r"], "with --num-nodes > 1 pass --main-address"),
        (["--rdzv-endpoint", "node0"], "--rdzv-endpoint 'node0': expected HOST:PORT"),
        (["--rdzv-endpoint", "a:1", "--main-port", "2"], "disagrees with --main-address/--main-port"),
        (["--progress-every", "-5"], "--progress-every -5.0: expected seconds >= 0 (0: no progress line)"),
        (["--progress-every", "nan"], "--progress-every nan: expected seconds >= 0"),
    ],
)
def test_inconsistent_options_are_rejected_before_anything_starts(argv, message, script, capsys):
    assert main(["run", *argv, str(script)]) == 2
    assert message in capsys.readouterr().err


def test_a_missing_script_and_an_unwritable_run_dir_are_clear_errors(tmp_path, script, capsys):
    assert main(["run", str(tmp_path / "nope.py")]) == 2
    assert f"SCRIPT {str(tmp_path / 'nope.py')!r} is not a file" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["run", "--run-dir", str(blocker / "run"), str(script)]) == 2
    err = capsys.readouterr().err
    assert f"--run-dir {str(blocker / 'run')!r} is not writable" in err


def test_the_lightning_executable_accepts_the_older_run_model_spelling(tmp_path, script):
    # Same parser, same checks: the error names the script, so `model` was read as the subcommand's noise word.
    proc = subprocess.run([str(LIGHTNING), "run", "model", "--devices", "1", str(tmp_path / "absent.py")],
                          env=clean_env(), check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "absent.py' is not a file" in proc.stderr
    proc = subprocess.run([str(LIGHTNING), "run", "--help"], env=clean_env(), check=False, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0 and "--nproc-per-node" in proc.stdout and "--max-restarts" in proc.stdout


def test_torchrun_aliases_and_defaults_become_one_c10d_rendezvous(tmp_path, script):
    from lightning_ett.launch.cli import _launch_options, build_parser

    args = build_parser().parse_args(["run", "--nnodes", "2", "--node_rank", "1", "--nproc-per-node", "4",
                                      "--rdzv-endpoint", "node0:29555", "--run-dir", str(tmp_path / "job-7"),
                                      str(script), "--lr", "0.1"])
    opts = _launch_options(args)
    assert (opts.num_nodes, opts.node_rank, opts.devices, opts.main_address, opts.main_port) == (2, 1, 4, "node0", 29555)
    assert opts.job_id == "job-7" and opts.script_args == ("--lr", "0.1")
    argv = torchrun_argv(opts)
    assert argv[argv.index("--rdzv-endpoint") + 1] == "node0:29555"
    assert argv[argv.index("--rdzv-conf") + 1] == "is_host=false"  # only node 0 hosts the store
    assert argv[-1] == str(script)  # the script's own arguments never meet torchrun's parser


def test_failure_reasons_name_the_signal_or_the_last_exception(tmp_path):
    log = tmp_path / "stderr.log"
    log.write_text("[rank1]:Traceback (most recent call last):\n[rank1]:  File \"x.py\", line 1\n"
                   "[rank1]:ValueError: bad batch\n[rank1]:wandb: finished\n")
    assert failure_reason(1, str(log)) == "exit code 1: ValueError: bad batch"
    log.write_text("lightning-ett fault injection: SIGKILL rank 1 at step 6 of attempt 0\n")
    assert failure_reason(-9, str(log)) == ("killed by SIGKILL "
                                            "(lightning-ett fault injection: SIGKILL rank 1 at step 6 of attempt 0)")
    assert failure_reason(-15, None) == "killed by SIGTERM"
    log.write_text("cannot start: bad config\n")
    assert failure_reason(1, str(log)) == "exit code 1: cannot start: bad config"
    assert failure_reason(-200, None) == "killed by signal 200"  # not a signal Python knows
    log.write_text("")
    assert failure_reason(3, str(log)) == "exit code 3"
    assert failure_reason(2, str(tmp_path / "missing.log")) == "exit code 2"
    # A DCP write that failed: the last exception line, one line, not the traceback objects DCP's repr holds.
    log.write_text("[rank0]:Traceback (most recent call last):\n[rank0]:lightning_ett.checkpoint.writer.CheckpointWriteError: "
                   "The background checkpoint write failed: No space left on device (ENOSPC) at '/ckpt/step-4.tmp'\n")
    assert failure_reason(1, str(log)) == ("exit code 1: lightning_ett.checkpoint.writer.CheckpointWriteError: The background "
                                           "checkpoint write failed: No space left on device (ENOSPC) at '/ckpt/step-4.tmp'")
    log.write_bytes(b"x" * 200_000 + b"\nKeyboardInterrupt\n")  # only the tail of a long log is read
    assert failure_reason(130, str(log)) == "exit code 130: KeyboardInterrupt"
    log.write_text("usage: train.py [-h] [--lr LR]\ntrain.py: error: argument --lr: invalid float value: 'x'\n")
    assert failure_reason(2, str(log)) == "exit code 2: train.py: error: argument --lr: invalid float value: 'x'"
    # Only a log that ends with a parser's error, exiting as a parser does (2, or 78 from a preloaded worker)
    log.write_text("fetch.sh: error: mirror 2 timed out, using mirror 1\ncheckpoint dir is read-only: giving up\n")
    assert failure_reason(1, str(log)) == "exit code 1: checkpoint dir is read-only: giving up"
    assert failure_reason(2, str(log)) == "exit code 2: checkpoint dir is read-only: giving up"


BAD_CLI_CONFIG = """
import sys
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.demos.boring_classes import BoringModel
LightningCLI(BoringModel, args=["fit", "--config", sys.argv[1]])
"""


@pytest.mark.parametrize(("name", "init_args", "named"), [
    ("AsyncCheckpoint", {"every_n_train_steps": "autoo"}, 'Parser key "every_n_train_steps": Given value: autoo'),
    ("AsyncCheckpoint", {"every_n_train_step": 10}, "Option 'every_n_train_step' is not accepted"),
    ("AsyncCheckpointt", {}, "module 'lightning_ett' has no attribute 'AsyncCheckpointt'"),  # a class path's typo
])
def test_a_lightningcli_config_error_is_named_by_its_key_and_value_not_by_the_list_it_was_in(tmp_path, name, init_args,
                                                                                            named):
    """jsonargparse ends its error with the whole callbacks list it was given; the reason must name the fault."""
    config = tmp_path / "config.yaml"
    callbacks = [{"class_path": "lightning_ett.ETTMonitor"},
                 {"class_path": f"lightning_ett.{name}", "init_args": {"dirpath": str(tmp_path), **init_args}}]
    config.write_text(json.dumps({"trainer": {"callbacks": callbacks}}))
    proc = run_script("-c", BAD_CLI_CONFIG, str(config), timeout=120)
    assert proc.returncode != 0
    log = tmp_path / "stderr.log"
    log.write_text(proc.stderr)
    reason = failure_reason(proc.returncode, str(log))
    assert reason.startswith(f"exit code {proc.returncode}: error: Parser key \"trainer.callbacks\": Problem with given "
                             f"class_path 'lightning_ett.{name}': "), reason
    assert reason.endswith(named) and "Namespace(" not in reason, reason


FIT_FROM = """
import sys
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
Trainer(accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
        enable_model_summary=False).fit(BoringModel(), ckpt_path=sys.argv[1])
"""


@pytest.mark.parametrize("what", ["missing", "empty directory"])
def test_a_fit_from_a_ckpt_path_lightning_cannot_open_is_not_retried(tmp_path, what):
    """A new-user trial (helper 67): a wrong fit(ckpt_path=...) under plain DDP failed every one of --max-restarts 3
    attempts the same way before the launcher gave up."""
    script = tmp_path / "job.py"
    script.write_text(FIT_FROM)
    path = tmp_path / ("nothing-here.ckpt" if what == "missing" else "empty")
    if what == "empty directory":
        path.mkdir()
    proc = launch(str(script), str(path), run_dir=tmp_path / "run", devices=1, max_restarts=3)
    assert proc.returncode != 0 and "gave up after 1 attempt(s)" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert "not retried" in proc.stderr + proc.stdout
    assert ("FileNotFoundError" if what == "missing" else "IsADirectoryError") in proc.stderr
    from lightning_ett.launch.worker import not_retryable

    assert not not_retryable(FileNotFoundError("a file the training step reads"))  # elsewhere: retried as before


def test_another_runs_lightningcli_config_in_the_log_dir_is_not_retried_and_not_overwritten(tmp_path):
    """A new-user trial (helper 70): a second LightningCLI job in the same directory failed at SaveConfigCallback,
    was retried, and its restart (ETTMonitor lets a job's own restart overwrite its config) overwrote the other
    run's config.yaml."""
    script = tmp_path / "cli.py"
    script.write_text("from lightning.pytorch.cli import LightningCLI\n"
                      "from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel\n"
                      "LightningCLI(BoringModel, BoringDataModule)\n")
    args = ("fit", "--trainer.accelerator", "cpu", "--trainer.max_steps", "2", "--trainer.logger", "false",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(tmp_path / "logs"))
    first = launch(str(script), *args, run_dir=tmp_path / "a", devices=1, max_restarts=1)
    assert first.returncode == 0, first.stderr[-3000:]
    config = (tmp_path / "logs" / "config.yaml").read_text()
    second = launch(str(script), *args, run_dir=tmp_path / "b", devices=1, max_restarts=1)
    said = second.stderr + second.stdout
    assert second.returncode != 0 and "gave up after 1 attempt(s)" in said and "not retried" in said, said[-3000:]
    assert "config.yaml to NOT exist" in said
    assert (tmp_path / "logs" / "config.yaml").read_text() == config


def test_an_unreadable_checkpoint_is_retried_at_a_later_attempt_or_outside_lightnings_load(tmp_path, monkeypatch):
    """Review 69: a restart may resume from a checkpoint the storage does not show yet (NFS, an object store), and a
    user's hook or a save may fail on a file: those are retried as before."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_ett.durable.errors import CHOSEN_CHECKPOINT_ATTR
    from lightning_ett.instrument.environment import ENV_ATTEMPT
    from lightning_ett.launch.worker import not_retryable

    def error_of(model: BoringModel, ckpt_path: str | None) -> BaseException:
        trainer = Trainer(accelerator="cpu", max_steps=1, logger=False, enable_progress_bar=False,
                          enable_checkpointing=False, enable_model_summary=False, default_root_dir=tmp_path)
        with pytest.raises(OSError) as caught:
            trainer.fit(model, ckpt_path=ckpt_path)
        return caught.value

    class ReadsAFile(BoringModel):
        def on_fit_start(self) -> None:
            (tmp_path / "a-file-it-reads").read_text()

    missing = str(tmp_path / "nothing-here.ckpt")
    monkeypatch.setenv(ENV_ATTEMPT, "0")
    assert not_retryable(error_of(BoringModel(), missing))  # the job's first attempt: fit's own ckpt_path
    assert not not_retryable(error_of(ReadsAFile(), None))  # a file elsewhere in the fit
    chosen = error_of(BoringModel(), missing)
    setattr(chosen, CHOSEN_CHECKPOINT_ATTR, True)  # AsyncCheckpoint chose it (rank 0 verified it; this rank's storage
    assert not not_retryable(chosen)  # may not show it yet): retried
    monkeypatch.setenv(ENV_ATTEMPT, "1")
    assert not not_retryable(error_of(BoringModel(), missing))  # a later attempt: the storage may catch up


def test_a_relaunch_into_the_same_run_dir_continues_the_attempt_numbers(tmp_path):
    assert next_attempt(tmp_path) == 0
    LedgerWriter(ledger_path(tmp_path, 2, 0)).close()
    assert next_attempt(tmp_path) == 3
    writer = LedgerWriter(launcher_ledger_path(tmp_path, 0))
    writer.append({"kind": "attempt", "attempt": 4, "time": 1.0})  # started, died before any rank wrote
    writer.close()
    assert next_attempt(tmp_path) == 5


def test_the_fault_switch_parses_and_rejects_malformed_values():
    assert parse_kill_faults("1:40") == (KillFault(1, 40, 0),)
    assert parse_kill_faults("1:40, 0:90:1") == (KillFault(1, 40, 0), KillFault(0, 90, 1))
    assert parse_kill_faults("") == ()
    for bad in ("1", "a:b", "1:2:3:4", "-1:5"):
        with pytest.raises(ValueError, match="LIGHTNING_ETT_FAULT_KILL=.*RANK:STEP"):
            parse_kill_faults(bad)


def test_a_kill_fault_fires_where_the_step_count_passes_its_step_without_stopping_on_it(monkeypatch):
    """Two optimizers under manual optimization advance global_step by 2: a fault at step 35 fires at 36."""
    killed: list[int] = []
    monkeypatch.setattr(faults_module.os, "kill", lambda pid, sig: killed.append(sig))
    faults = parse_kill_faults("1:35")
    for rank, step, attempt in [(1, 34, 0), (0, 36, 0), (1, 36, 1)]:  # before it; another rank; another attempt
        maybe_kill(faults, rank, step, attempt)
    assert killed == []
    maybe_kill(faults, 1, 36, 0, began_at=35)  # a fit resumed at step 35 never completes it
    assert killed == []
    maybe_kill(faults, 1, 36, 0)
    assert killed == [faults_module.signal.SIGKILL]
    maybe_kill(parse_kill_faults("1:0"), 1, 0, 0)  # step 0: the first batch of a fresh fit (under accumulation)
    assert len(killed) == 2


def test_the_failure_rate_switch_draws_the_same_failures_for_the_same_seed(monkeypatch):
    monkeypatch.setenv("LIGHTNING_ETT_FAULT_MTBF_S", "60:7")
    failures = random_failures_from_env()
    assert failures == RandomFailures(60.0, 7)
    deadlines = [failures.deadline_s(a) for a in range(400)]
    assert deadlines == [RandomFailures(60.0, 7).deadline_s(a) for a in range(400)]  # any job, same seed: same failures
    assert deadlines != [RandomFailures(60.0, 8).deadline_s(a) for a in range(400)]
    assert 45 < sum(deadlines) / len(deadlines) < 75  # exponential with mean 60 s
    assert {failures.victim(a, 2) for a in range(50)} == {0, 1}
    for bad in ("0", "x", "60:a", "60:1:2"):
        monkeypatch.setenv("LIGHTNING_ETT_FAULT_MTBF_S", bad)
        with pytest.raises(ValueError, match="LIGHTNING_ETT_FAULT_MTBF_S=.*SECONDS\\[:SEED\\]"):
            random_failures_from_env()


def test_the_root_cause_is_the_rank_that_died_first_not_the_peers_it_took_down(tmp_path):
    import os
    from types import SimpleNamespace

    from lightning_ett.instrument.ledger import read_launcher_records
    from lightning_ett.launch.launcher import LaunchOptions, LaunchRecorder

    logs = {}
    for local_rank, (text, age) in enumerate([("quiet since start-up\n", 60), ("RuntimeError: bad batch\n", 5),
                                               ("RuntimeError: Connection closed by peer\n", 1)]):
        logs[local_rank] = str(tmp_path / f"stderr{local_rank}.log")
        (tmp_path / f"stderr{local_rank}.log").write_text(text)
        os.utime(logs[local_rank], (1e9 - age, 1e9 - age))
    recorder = LaunchRecorder(LaunchOptions(script="x.py", script_args=(), devices=3, run_dir=tmp_path / "run"), 0.0)
    recorder.starting_workers()
    failures = {r: SimpleNamespace(local_rank=r, exitcode=code) for r, code in [(0, -9), (1, 1), (2, 1)]}
    # Rank 0 was stuck in a collective and killed by the agent after its grace period: not a suspect.
    recorder.workers_failed(failures, logs, suspects={1, 2})
    records = {r["rank"]: r for r in read_launcher_records(tmp_path / "run") if r["kind"] == "failure"}
    assert records[1]["root_cause"] and records[1]["reason"] == "exit code 1: RuntimeError: bad batch"
    assert records[2]["reason"] == "failed after rank 1: exit code 1: RuntimeError: Connection closed by peer"
    assert records[0]["reason"] == "stopped by the launcher after another rank failed"
    assert recorder.last_failure == "rank 1 exit code 1: RuntimeError: bad batch"


def test_a_rank_that_raised_only_because_another_failed_is_not_the_root_cause(tmp_path):
    import os
    from types import SimpleNamespace

    from lightning_ett.durable.errors import ANOTHER_RANKS_ERROR
    from lightning_ett.launch.launcher import LaunchOptions, LaunchRecorder

    logs = {}
    for local_rank, (text, age) in enumerate([("IsADirectoryError: [Errno 21] taking the lock failed\n", 1),
                                               (f"RuntimeError: taking the lock failed {ANOTHER_RANKS_ERROR}.\n", 2)]):
        logs[local_rank] = str(tmp_path / f"stderr{local_rank}.log")
        (tmp_path / f"stderr{local_rank}.log").write_text(text)
        os.utime(logs[local_rank], (1e9 - age, 1e9 - age))  # rank 1's echo was written first
    recorder = LaunchRecorder(LaunchOptions(script="x.py", script_args=(), devices=2, run_dir=tmp_path / "run"), 0.0)
    recorder.starting_workers()
    recorder.workers_failed({r: SimpleNamespace(local_rank=r, exitcode=1) for r in (0, 1)}, logs, suspects={0, 1})
    assert recorder.last_failure == "rank 0 exit code 1: IsADirectoryError: [Errno 21] taking the lock failed"


def test_the_failure_rate_switch_really_kills_a_rank(tmp_path):
    # One rank, MTBF 0.3 s: killed by SIGKILL after a draw of training time (seed 1), long before step 2000.
    proc = run_script(str(SCRIPTS / "boring_job.py"), "--run-dir", str(tmp_path / "run"), "--max-steps", "2000",
                      "--step-sleep", "0.01", timeout=120, LIGHTNING_ETT_FAULT_MTBF_S="0.3:1")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    deadline = RandomFailures(0.3, 1).deadline_s(0)
    assert "lightning-ett fault injection: SIGKILL rank 0 after" in proc.stderr
    trained = summarize_run_dir(tmp_path / "run").phases["train"]
    assert deadline <= trained + 0.5 and trained < 20 * 0.01 + deadline + 5  # it died at the drawn time, not at the end


def test_the_forkserver_preloads_inductor_only_for_a_job_that_compiles(tmp_path):
    from lightning_ett.launch.worker import COMPILE_PRELOAD, PRELOAD, modules_to_preload

    plain = tmp_path / "train.py"
    plain.write_text("from lightning.pytorch import Trainer\n")
    assert modules_to_preload(str(plain)) == PRELOAD  # inductor's import would only delay the first workers
    compiled = tmp_path / "train_compiled.py"
    compiled.write_text("model = torch.compile(model)\n")
    assert set(COMPILE_PRELOAD) <= set(modules_to_preload(str(compiled)))
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n  callbacks:\n    - class_path: lightning_ett.CompileCache\n")
    assert set(COMPILE_PRELOAD) <= set(modules_to_preload(str(plain), ("--config", str(config))))
    assert modules_to_preload(str(tmp_path / "missing.py")) == PRELOAD
    logged = tmp_path / "train_logged.py"
    logged.write_text("from lightning.pytorch.loggers import WandbLogger\n")
    assert "wandb" not in modules_to_preload(str(logged))  # its import makes a media dir the first exit deletes


def test_which_errors_are_not_retried(isolated_job):
    import argparse

    from lightning_ett.durable.errors import ConfigurationError, ConfigurationTypeError
    from lightning_ett.durable.ownership import DirectoryInUseError
    from lightning_ett.launch.worker import _usage_error, not_retryable

    assert not_retryable(ConfigurationError("AsyncCheckpoint(every_n_train_steps=0): ..."))
    assert not_retryable(ConfigurationTypeError("ETTMonitor(run_dir=3): ...")) and issubclass(ConfigurationTypeError, TypeError)
    assert not_retryable(DirectoryInUseError("in use")) and not_retryable(SyntaxError("bad"))
    assert not not_retryable(ValueError("a data bug")) and not not_retryable(RuntimeError("NCCL error"))
    assert not_retryable(ModuleNotFoundError("No module named 'x'"))  # before training: a missing package
    isolated_job.record("train", 1.0, 2.0)
    assert not not_retryable(ImportError("file too short"))  # mid-training: a race a retry mends

    try:
        argparse.ArgumentParser().parse_args(["--nope"])
    except SystemExit as stop:
        assert _usage_error(stop)
    try:
        raise SystemExit(2)  # a script's own exit code 2 is not a usage error
    except SystemExit as stop:
        assert not _usage_error(stop)
