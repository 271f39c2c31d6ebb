"""The report reads what it can: torn and malformed ledger lines are skipped and counted, never a crash."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import LIGHTNING, clean_env

from lightning_ett.instrument.ledger import (
    LedgerWriter,
    launcher_ledger_path,
    ledger_path,
    read_launcher_records,
    read_ledger,
)
from lightning_ett.instrument.summary import summarize_run_dir
from lightning_ett.launch.cli import main

BAD_LINES = [
    '{"kind":"event","phase":"train","start":"x","end":null}',  # valid JSON, wrong types: was a TypeError
    "[1,2]",  # not an object: was an AttributeError
    '"just a string"',
    '{"kind":"event","phase":"train","start":5.0,"end":1.0}',  # ends before it starts
    '{"kind":"event","phase":"train","start":1.0,"end":2.0,"step":"3"}',
    '{"kind":"header","job_start":"yesterday"}',
    '{"kind":"status","status":["finished"]}',
    '{"kind":"event","phase":"warp_drive","start":1.0,"end":2.0}',  # a phase this version does not know
    '{"kind":"event","phase":"train","start":1.0,"end":Infinity}',
    '{"kind":"event","phase":"tra',  # torn by a kill mid-write
    '{"kind":"event","phase":"train","start":1' + "0" * 400 + ',"end":2.0}',  # an int no float holds: OverflowError
]


def write_run(run: Path, bad: bool) -> None:
    writer = LedgerWriter(ledger_path(run, 0, 0))
    writer.append({"kind": "header", "rank": 0, "attempt": 0, "job_start": 100.0})
    for step in range(3):
        writer.append({"kind": "event", "phase": "train", "start": 101.0 + step, "end": 102.0 + step, "rank": 0,
                       "attempt": 0, "step": step})
    writer.append({"kind": "status", "status": "finished", "time": 104.0})
    writer.close()
    launcher = LedgerWriter(launcher_ledger_path(run, 0))
    launcher.append({"kind": "launch", "time": 100.0, "job_start": 100.0})
    launcher.append({"kind": "attempt", "attempt": 0, "time": 100.5})
    launcher.append({"kind": "end", "time": 105.0, "exitcode": 0, "reason": "finished"})
    launcher.close()
    if bad:
        with open(ledger_path(run, 0, 0), "a") as f:
            f.write("\n".join(BAD_LINES) + "\n")
        with open(launcher_ledger_path(run, 0), "a") as f:
            f.write('[3]\n{"kind":"failure","attempt":"zero","rank":1,"time":"later"}\n{"kind":"end","time":"x"}\n'
                    '{"kind":"failure","attempt":0,"rank":1,"time":104.5}\n'  # a failure that does not say why
                    '{"kind":"node_lost","attempt":0,"node_rank":1,"since":101.0,"time":102.0}\n'  # no address
                    '{"kind":"node_lost","attempt":0,"node_rank":1,"address":"h","time":102.0,"since":1' + "0" * 400
                    + '}\n{"kind":"failure","attempt":0,"rank":0,"time":103.0,"reason":"x","hang":"stuck"}\n')


def test_malformed_lines_are_skipped_and_counted_and_the_numbers_do_not_change(tmp_path, capsys):
    write_run(tmp_path / "good", bad=False)
    write_run(tmp_path / "bad", bad=True)
    (ledger,) = read_ledger(tmp_path / "bad")
    assert ledger.torn_lines == len(BAD_LINES) and len(ledger.events) == 3 and ledger.status == "finished"
    assert [r["kind"] for r in read_launcher_records(tmp_path / "bad")] == ["launch", "attempt", "end"]
    good, bad = summarize_run_dir(tmp_path / "good"), summarize_run_dir(tmp_path / "bad")
    assert bad.to_dict()["phases"] == good.to_dict()["phases"] and bad.ett_percent == good.ett_percent == 60.0
    assert bad.torn_records == len(BAD_LINES)
    assert main(["report", str(tmp_path / "bad")]) == 0
    out = capsys.readouterr().out
    assert "ETT 60.0%" in out and f"{len(BAD_LINES)} ledger line(s) skipped" in out
    assert "No training process recorded a phase" not in out  # the ranks did record theirs
    assert json.loads((tmp_path / "bad" / "ett_summary.json").read_text())["torn_records"] == len(BAD_LINES)


def test_a_malformed_fact_is_left_out_of_the_report(tmp_path, capsys):
    write_run(tmp_path, bad=False)
    with open(ledger_path(tmp_path, 0, 0), "a") as f:
        f.write('{"kind":"fact","name":"checkpoint_cadence","time":104.0,"interval_steps":"often"}\n')
    assert main(["report", str(tmp_path)]) == 0
    assert "checkpoint cadence" not in capsys.readouterr().out


def run_script_text(tmp_path: Path, text: str) -> str:
    """``text`` as a script under ``lightning run`` (no preload); its printed output, whitespace collapsed."""
    script = tmp_path / "script.py"
    script.write_text(text)
    proc = subprocess.run([LIGHTNING, "run", "--no-preload", "--run-dir", str(tmp_path / "run"), str(script)],
                          check=False, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return " ".join(proc.stdout.split())


def test_a_script_that_exits_0_before_training_is_reported_as_finished_everywhere(tmp_path):
    out = run_script_text(tmp_path, "import sys\nfrom lightning_ett import ETTMonitor\nETTMonitor()\nsys.exit(0)\n")
    summary = summarize_run_dir(tmp_path / "run")
    assert summary.outcome == "finished" and summary.completed and [a.completed for a in summary.attempts] == [True]
    # (Under the hang watch ETTMonitor opens its ledger when it is built, so the rank recorded its import phase.)
    assert "1 attempt(s), finished" in out and "│ finished" in out
    assert "running or failed" not in out and "no status" not in out


def test_a_job_without_ettmonitor_is_told_why_its_report_has_no_ett(tmp_path):
    out = run_script_text(tmp_path, "print('trained without ETTMonitor')\n")
    assert "No training process recorded a phase, so there is no ETT% to measure: add ETTMonitor()" in out, out


def test_a_ledger_of_nothing_but_invalid_lines_says_how_many_it_skipped(tmp_path, capsys):
    ledger_path(tmp_path, 0, 0).parent.mkdir(parents=True)
    ledger_path(tmp_path, 0, 0).write_text("\n".join(BAD_LINES) + "\n")
    status = main(["report", str(tmp_path)])
    said = capsys.readouterr()
    assert status != 0 and f"{len(BAD_LINES)} line(s) skipped as invalid" in said.out + said.err, said
    assert "no events yet" not in said.out + said.err


def test_the_report_caption_says_how_the_launcher_ended_the_job(tmp_path):
    import dataclasses

    from rich.console import Console

    from lightning_ett.instrument.report import render_table

    write_run(tmp_path, bad=False)
    summary = summarize_run_dir(tmp_path)
    summary = dataclasses.replace(summary, attempts=[dataclasses.replace(a, completed=False) for a in summary.attempts])
    for outcome, said in (("gave up after 2 attempt(s) (--max-restarts 1); last failure: x", "gave up"),
                          ("launcher error: OSError: [Errno 28] No space left on device", "launcher error"),
                          (None, "running or failed")):
        console = Console(width=200, record=True)
        console.print(render_table(dataclasses.replace(summary, outcome=outcome)))
        assert f"attempt(s), {said};" in console.export_text(), outcome
