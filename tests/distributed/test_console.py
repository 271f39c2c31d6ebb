"""What a user reads: the example's console under `lightning run` (2 real gloo ranks), as a user would run it."""

from __future__ import annotations

import collections
import re
from pathlib import Path

import yaml
from conftest import REPO, lightning_run, run_script

from lightning_ett.instrument.quiet import UPSTREAM_DEPRECATIONS

EXAMPLE = REPO / "examples" / "dlrm_example.py"


def example_config(tmp_path: Path, steps: int, save_every: int) -> Path:
    """examples/dlrm.yaml, shorter, saving often: each save is where torch's deprecations used to be reprinted."""
    config = yaml.safe_load((REPO / "examples" / "dlrm.yaml").read_text())
    trainer = config["trainer"]
    trainer.update(max_steps=steps, val_check_interval=steps // 2, limit_val_batches=2)
    for callback in trainer["callbacks"]:
        if callback["class_path"].endswith("AsyncCheckpoint"):
            callback["init_args"]["every_n_train_steps"] = save_every
            callback["init_args"]["when_busy"] = "wait"  # every save happens, however slow the disk (not 'skip')
            callback["init_args"]["verbose"] = True  # a line per save (the default says a fit's first and last)
    path = tmp_path / "dlrm.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def warning_lines(console: str) -> list[tuple[str, str]]:
    """(rank prefix, text) of every warning line; the launcher's own lines have the prefix ''."""
    found = []
    for line in console.splitlines():
        prefix, text = re.match(r"(\[default\d+\]:)?(.*)", line).groups()
        if re.search(r"warn|deprecat", text, re.IGNORECASE):
            found.append((prefix or "", text))
    return found


def test_the_examples_console_repeats_no_warning(tmp_path):
    config = example_config(tmp_path, steps=120, save_every=20)  # 6 saves, 4 straggler windows
    proc = lightning_run("--devices", "2", "--max-restarts", "0", "--run-dir", str(tmp_path / "run"),
                         "--progress-every", "1", str(EXAMPLE), "fit", "--config", str(config), "--data.batch_size", "128",
                         cwd=tmp_path)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-4000:]
    assert console.count("AsyncCheckpoint: step") >= 6  # the saves happened
    # The progress line, as a log file gets it (not a terminal): step, steps/s, ETT% so far, phase
    progress = re.findall(r"^lightning run: attempt 0 · step (\d+)( · [\d.]+ steps/s)?(?: · ETT ([\d.]+)% so far)? · (\w+)$",
                          proc.stdout, re.MULTILINE)  # (the rate from the second line; ETT% once a summary is made)
    assert len(progress) >= 2 and all(rate for _, rate, _, _ in progress[1:]), proc.stdout[-3000:]
    assert any(ett for _, _, ett, _ in progress), proc.stdout[-3000:]
    assert [int(step) for step, _, _, _ in progress] == sorted(int(step) for step, _, _, _ in progress)
    assert all(0 <= float(ett) <= 100 for _, _, ett, _ in progress if ett)
    repeated = {line: n for line, n in collections.Counter(warning_lines(console)).items() if n > 1}
    assert not repeated, repeated
    # TorchRec and torch, driven as ETTStrategy drives them (planning, DMP, six saves), say nothing a user could act on
    assert "TopologyFactory" not in console and "dense tensor size calculation" not in console, console[-4000:]
    assert not [m for m, _ in UPSTREAM_DEPRECATIONS if re.search(m, console)] and "is_fx_tracing" not in console
    assert "FutureWarning" not in console, console[-4000:]  # (a reworded notice would show here)
    assert any((tmp_path / "ett_runs" / "plan_cache").iterdir())  # (it planned: a fresh cache, then its plan stored)


def report_figures(text: str) -> list[str]:
    """The report's figures as printed: its title line, table rows and fact lines (paths and colours aside)."""
    keep = []
    for line in text.splitlines():
        line = re.sub(r"^\[default\d+\]:", "", line).strip()
        if re.match(r"(ETT [\d.]+% of|│|checkpoint cadence|published models|straggler|\d+ attempt)", line):
            keep.append(line)
    starts = [i for i, line in enumerate(keep) if line.startswith("ETT ")]
    return keep[starts[-1]:] if starts else []  # (the model summary's table before it is not the report)


def test_the_final_report_and_a_later_report_agree_and_the_later_one_rewrites_nothing(tmp_path):
    config = example_config(tmp_path, steps=40, save_every=20)
    run_dir = tmp_path / "run"
    proc = lightning_run("--devices", "2", "--max-restarts", "0", "--run-dir", str(run_dir), "--progress-every", "0",
                         str(EXAMPLE), "fit", "--config", str(config), "--data.batch_size", "128", cwd=tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert " steps/s · " not in proc.stdout  # --progress-every 0: no progress line
    printed = report_figures(proc.stdout)
    assert printed and printed[0].startswith("ETT "), proc.stdout[-3000:]
    assert any("no failure seen yet" in line for line in printed), printed  # no overhead predicted from nothing
    written = {name: ((run_dir / name).read_bytes(), (run_dir / name).stat().st_mtime_ns)
               for name in ("ett_summary.json", "ett_report.png")}
    later = run_script("-m", "lightning_ett.launch.cli", "report", str(run_dir))
    assert later.returncode == 0, later.stderr
    assert report_figures(later.stdout) == printed
    assert written == {name: ((run_dir / name).read_bytes(), (run_dir / name).stat().st_mtime_ns) for name in written}
