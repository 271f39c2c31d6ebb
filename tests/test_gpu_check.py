"""benchmarks/gpu_check.py: it must work first time on a GPU machine without TorchRec, so its CPU paths run here."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, clean_env

SCRIPT = REPO / "benchmarks" / "gpu_check.py"


def _load() -> object:
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run the check")
def test_without_cuda_it_says_so_and_exits_0() -> None:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(SCRIPT)], env=clean_env(), capture_output=True, text=True, timeout=60,
                          check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "needs a CUDA GPU" in proc.stdout
    assert time.monotonic() - start < 30  # imports torch only: no section, no child process


def test_what_the_children_import_loads_without_torchrec_and_fbgemm() -> None:
    """As on the GPU image: both blocked. The negative control shows the block bites (the strategies package needs
    TorchRec), so the pieces loading is not an accident of this machine having TorchRec installed."""
    code = textwrap.dedent(f"""
        import importlib, importlib.util, sys
        sys.modules["torchrec"] = None
        sys.modules["fbgemm_gpu"] = None
        try:
            importlib.import_module("lightning_ett.strategies")
        except ImportError as e:
            print("control: strategies package needs torchrec:", type(e).__name__)
        else:
            raise SystemExit("the block did not bite: lightning_ett.strategies imported without torchrec")
        for name in [n for n in sys.modules if n.startswith("lightning_ett.strategies")]:
            del sys.modules[name]
        spec = importlib.util.spec_from_file_location("gpu_check", {str(SCRIPT)!r})
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module
        spec.loader.exec_module(module)
        pieces = module.import_pieces()
        print("pieces:", sorted(vars(pieces)))
        print("classes:", pieces.AsyncCheckpoint.__name__, pieces.ETTMonitor.__name__, pieces.CompileCache.__name__,
              pieces.DynamicShapes.__name__, pieces.BackgroundTask.__name__, pieces.Trainer.__module__)
        assert callable(pieces.init_process_group) and pieces.default_backend.__module__.endswith("process_group")
        assert sys.modules["torchrec"] is None and sys.modules["fbgemm_gpu"] is None
        assert "lightning_ett.strategies" not in sys.modules, "the strategies package (and ett.py) was imported"
        print("OK")
    """)
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=120,
                          check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "control: strategies package needs torchrec: ModuleNotFoundError" in proc.stdout
    assert "classes: AsyncCheckpoint ETTMonitor CompileCache DynamicShapes BackgroundTask lightning.pytorch" in proc.stdout
    assert proc.stdout.rstrip().endswith("OK")


def test_copy_streams_reads_a_chrome_trace() -> None:
    events = [
        {"cat": "kernel", "name": "gemm", "args": {"stream": 7}},
        {"cat": "kernel", "name": "adam", "args": {"stream": 7}},
        {"cat": "kernel", "name": "other", "args": {"stream": 20}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"stream": 13, "bytes": 3 << 20}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "args": {"stream": 13, "bytes": 1 << 20}},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "args": {"stream": 7, "bytes": 5 << 20}},
        {"cat": "cpu_op", "name": "aten::copy_", "args": {}},
    ]
    streams = gpu_check.copy_streams(events)
    assert streams["compute_stream"] == "7"
    assert streams["d2h_bytes_by_stream"] == {"13": 4 << 20}
    assert streams["d2h_bytes_by_kind"] == {"Memcpy DtoH (Device -> Pinned)": 4 << 20}
    ok, detail = gpu_check._stream_verdict(streams, cuda=True)
    assert ok is True, detail

    events.append({"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pageable)", "args": {"stream": 7, "bytes": 1 << 20}})
    ok, detail = gpu_check._stream_verdict(gpu_check.copy_streams(events), cuda=True)
    assert ok is False and "compute stream 7: 1.0 MiB" in detail
    assert gpu_check._stream_verdict(gpu_check.copy_streams([]), cuda=True)[0] is None  # no CUPTI: n/a, not a pass
    assert gpu_check._stream_verdict(None, cuda=False)[0] is None


def test_a_failing_section_is_a_row_the_others_still_run_and_the_exit_code_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ran: list[str] = []

    def boom(run: object, sec: object) -> None:
        ran.append("pg")
        raise RuntimeError("injected failure")

    def fine(run: object, sec: object) -> None:
        ran.append("checkpoint")
        sec.row("something", "1.000 s")  # type: ignore[attr-defined]
        sec.check("a check", True, "")  # type: ignore[attr-defined]

    monkeypatch.setattr(gpu_check, "SECTION_RUNNERS", {"pg": boom, "checkpoint": fine})
    out = tmp_path / "figures.json"
    code = gpu_check.main(["--device", "cpu", "--sections", "pg,checkpoint", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 1 and ran == ["pg", "checkpoint"]
    assert "FAILED" in printed and "RuntimeError: injected failure" in printed
    assert "1/2 section(s) ok" in printed and "total elapsed" in printed
    figures = json.loads(out.read_text())
    assert figures["ok"] is False
    pg = figures["sections"]["pg"]
    assert (pg["ok"], pg["error"], pg["figures"], pg["checks"]) == (False, "RuntimeError: injected failure", {}, [])
    assert figures["sections"]["checkpoint"]["ok"] is True


def test_out_defaults_to_the_out_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gpu_check, "SECTION_RUNNERS", {"pg": lambda run, sec: sec.check("fails", False, "on purpose")})
    monkeypatch.setenv("OUT", str(tmp_path))
    assert gpu_check.main(["--device", "cpu", "--sections", "pg"]) == 1  # a failed check fails its section
    assert json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["pg"]["checks"] == [
        {"check": "fails", "ok": False, "detail": "on purpose"}]


def test_a_child_past_its_time_limit_is_killed_and_reported(tmp_path: Path) -> None:
    args = argparse.Namespace(device="cpu", deadline=120.0, without_torchrec=False)
    run = gpu_check.Run(args, tmp_path)
    start = time.monotonic()
    with pytest.raises(gpu_check.ChildFailed) as failed:
        run.children("sleep", {"s": 600}, limit_s=6)
    assert time.monotonic() - start < 30
    assert "TimeoutError: child sleep ran past its 6 s limit (killed)" in str(failed.value)
    assert failed.value.figures == {"slept": "started"}  # what it had reported before the limit comes back


def test_cpu_dry_run_of_the_sections(tmp_path: Path) -> None:
    """The GPU run's code paths end to end on CPU (gloo, small models, aot_eager; CUDA-only checks n/a), TorchRec
    blocked. CompileCache's section is left out here for time (inductor on 2 cores: ~45 s); run it by hand with
    ``--device cpu --without-torchrec``."""
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--without-torchrec", "--backend", "aot_eager",
                           "--sections", "pg,checkpoint,dynamic_shapes,hang,pipeline", "--deadline", "280", "--out", str(out)],
                          env=clean_env(), capture_output=True, text=True, timeout=300, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    figures = json.loads(out.read_text())
    assert figures["ok"] and figures["without_torchrec"]
    sections = figures["sections"]
    pg = sections["pg"]["figures"]
    assert {r["backend"] for r in pg["both"]} == {"gloo"} and len(pg["both"]) == 2
    assert all(r["group_ok"] for r in pg["both"]) and pg["both_s"] > 0 and pg["overlap_ratio"] > 0
    ckpt = sections["checkpoint"]["figures"]
    kinds = [s["kind"] for s in ckpt["saves"]]
    assert kinds == ["first (allocates staging)"] + ["measured"] * 3 + ["profiled", "final (on_train_end)"]
    assert all(s["bytes"] > 0 for s in ckpt["saves"]) and ckpt["resume"]["params_equal"] and ckpt["resume"]["adam_state_equal"]
    assert ckpt["phases"]["checkpoint_save"] > 0 and ckpt["newest_is_last_step"]
    checks = {c["check"]: c["ok"] for c in sections["checkpoint"]["checks"]}
    assert checks["staging buffers pinned"] is None and checks["device-to-host copy off the compute stream"] is None
    dyn = sections["dynamic_shapes"]["figures"]
    assert dyn["plain"]["recompiles"] >= 1 and dyn["dynamic_shapes"]["recompiles"] == 0
    hang = sections["hang"]["figures"]["gloo-2"]  # on CUDA: nccl-2 (2+ GPUs), or nccl-1 and gloo-2 (one GPU)
    assert hang["named"] == 1 and hang["status"]["0"] != hang["status"]["1"] and hang["working"] == {}
    assert "not run: torchrec is not installed" in proc.stdout  # the pipeline section, as on the GPU image
    assert "total elapsed" in proc.stdout and "5/5 section(s) ok" in proc.stdout
    # nothing that needs rich, matplotlib or wandb (which the GPU image may lack) was imported by the children
    assert ckpt["needs_missing_optional"] == [] and dyn["plain"]["needs_missing_optional"] == []
    assert all(r["needs_missing_optional"] == [] for r in pg["both"])


def test_the_pipeline_section_runs_where_torchrec_is_installed(tmp_path: Path) -> None:
    """On CPU it walks its code path: the three arms run, their figures come back, the pipeline engaged."""
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--sections", "pipeline", "--out", str(out)],
                          env=clean_env(), capture_output=True, text=True, timeout=300, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    section = json.loads(out.read_text())["sections"]["pipeline"]
    assert set(section["figures"]["step_s"]) == {"pipeline", "lightning", "lightning_plain"}
    assert all(s > 0 for s in section["figures"]["step_s"].values())
    assert section["figures"]["pipelined_calls"] > 0
    assert [c["ok"] for c in section["checks"]] == [True]


def test_the_2d_kernel_section_runs_where_torchrec_is_installed(tmp_path: Path) -> None:
    """Its planner half needs TorchRec but no GPU; the GPU image has no TorchRec, so CPU CI is where it runs."""
    out = tmp_path / "figures.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--sections", "kernels_2d", "--out", str(out)],
                          env=clean_env(), capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    checks = {c["check"]: c["ok"] for c in json.loads(out.read_text())["sections"]["kernels_2d"]["checks"]}
    assert checks == {"2D planner avoids fused_uvm_caching": True, "a cached plan is refused": True,
                      "cache rows invisible to split_embedding_weights": None}
