"""CompileCache: a second process reuses the first one's compile artifacts (real torch.compile, inductor)."""

from __future__ import annotations

import functools
import json
import shutil
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from conftest import SCRIPTS, run_script
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_ett import CompileCache, summarize_run_dir

JOB = str(SCRIPTS / "compile_job.py")


def run(tmp_path, name: str, cache, *flags: str, **env: str) -> tuple[dict, str]:
    """One start of the job in a fresh process, with a new, empty default inductor directory (another host's)."""
    out = tmp_path / name
    proc = run_script(JOB, "--out", str(out), "--compile-cache", str(cache), "--sizes", "512,384", "--dynamic-shapes",
                      *flags, timeout=240,
                      TORCHINDUCTOR_CACHE_DIR=str(tmp_path / f"default-inductor-{name}"), **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads((out / "compile.json").read_text())
    facts["compile_phase_s"] = summarize_run_dir(out / "ett").phases["compile"]
    return facts, proc.stderr


@pytest.fixture(scope="module")
def cold_cache(tmp_path_factory) -> tuple[Path, dict]:
    """One cold compile into a fresh cache, shared by this module's tests (each compile costs ~10 s here)."""
    tmp_path = tmp_path_factory.mktemp("cold")
    cold, _ = run(tmp_path, "cold", tmp_path / "cache")
    return tmp_path / "cache", cold


def test_a_restart_reuses_the_compile_cache_and_another_model_does_not(tmp_path, cold_cache):
    cache, cold = cold_cache
    assert cold["cache"]["compile/fx_cache_misses"] > 0 and cold["cache"]["compile/fx_cache_hits"] == 0
    assert (cache / "mega_cache.bin").is_file() and (cache / "inductor").is_dir()

    libraries = shared_libraries(cache)
    headers = list((cache / "inductor" / "precompiled_headers").glob("*/*.h.gch"))  # one sub-directory per host CPU
    assert headers and all(h.read_bytes()[:4] == b"gpch" for h in headers), "the precompiled header stayed in /tmp"
    empty_tmp = tmp_path / "empty-tmp"
    empty_tmp.mkdir()
    # Same cache directory, another host's empty /tmp (where inductor keeps its precompiled header by default).
    warm, _ = run(tmp_path, "warm", cache, TMPDIR=str(empty_tmp))
    assert warm["cache"]["compile/fx_cache_hits"] > 0 and warm["cache"]["compile/fx_cache_misses"] == 0
    assert warm["cache"]["compile/aot_cache_hits"] > 0
    # ... and no C++ built again (issues #15, #31): the cold run's kernels, keyed by their compiler command
    # line, and its precompiled header are found; the one compiler run left is inductor's header
    # preprocessing, done in every process.
    assert shared_libraries(cache) == libraries, "the restart compiled C++ the cold run had compiled"
    assert warm["cache"]["compile/cpp_compiles"] <= 1 < cold["cache"]["compile/cpp_compiles"]
    assert warm["loaded"] and warm["loaded"].get("inductor", 0) > 0  # the bundle was loaded too
    assert 0 < warm["compile_phase_s"] < cold["compile_phase_s"]

    # Another host: only the portable bundle travels, no inductor directory.
    moved = tmp_path / "moved"
    moved.mkdir()
    for name in ("mega_cache.bin", "mega_cache.json"):
        shutil.copy(cache / name, moved / name)
    bundle_only, _ = run(tmp_path, "bundle", moved)
    assert bundle_only["cache"]["compile/fx_cache_hits"] > 0

    other, _ = run(tmp_path, "other", cache, "--width", "32")  # a different model, same directory
    assert other["cache"]["compile/fx_cache_hits"] == 0 and other["cache"]["compile/aot_cache_hits"] == 0


def shared_libraries(cache: Path) -> set[str]:
    return {p.name for p in (cache / "inductor").rglob("*.so")}


ISA_FLAGS = """
import json, sys, time
from torch._inductor.cpu_vec_isa import pick_vec_isa
if sys.argv[1] == "alone":
    print(json.dumps([pick_vec_isa().build_arch_flags()]))
else:  # what CompileCache.setup does, then a compile's first ISA lookup at once
    from lightning_ett.compile.cache import IsaProbe
    probe, seen = IsaProbe(), []
    while not probe.wait(0.005):
        seen.append(pick_vec_isa().build_arch_flags())
    seen.append(pick_vec_isa().build_arch_flags())
    print(json.dumps(sorted(set(seen))))
"""


def test_a_compile_beside_the_background_isa_probe_uses_the_flags_of_a_process_alone(tmp_path):
    """The C++ command line (which keys every compiled kernel) must not depend on timing (issue #15).

    Inductor's AVX-512 BF16 check edits the shared ISA object's flags around a test build; a lookup
    made while CompileCache's background probe ran saw (or, interleaved, kept) ``-mavx512bf16``.
    The first process starts with an empty inductor directory, so its probe builds libraries for
    seconds and the lookup overlaps it (a host without AVX-512 BF16 has nothing to get wrong).
    """
    def flags(mode: str) -> list[str]:
        proc = run_script("-c", ISA_FLAGS, mode, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    beside = flags("beside-probe")
    assert beside == flags("alone")  # (the second finds the probe libraries built: only dlopen checks)


class CompiledLayer(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.layer.compile(backend="eager")  # a compiled submodule (eager: no C++ build, no ISA lookup of its own)


def test_the_isa_probe_runs_only_where_a_module_is_compiled_and_is_never_cut_off(tmp_path, monkeypatch):
    """A job that compiles nothing ended ~10 s late on 2 busy cores waiting for a probe it never used; one that
    compiles must not end mid-probe (a half-built probe library is never rebuilt and changes inductor's flags)."""
    from torch._inductor import cpu_vec_isa

    probed = threading.Event()

    @functools.cache
    def slow_probe() -> list:  # inductor's probe, slowed down
        threading.Event().wait(1.0)
        probed.set()
        return []

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", slow_probe)

    def fit(model: BoringModel) -> CompileCache:
        cache = CompileCache(tmp_path / "cache")
        trainer = Trainer(accelerator="cpu", max_steps=3, callbacks=[cache], logger=False, enable_progress_bar=False,
                          enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(model)
        assert trainer.global_step == 3
        return cache

    assert fit(BoringModel())._isa_probe is None and not probed.is_set()  # nothing compiled: no probe
    assert fit(torch.compile(BoringModel(), backend="eager"))._isa_probe is not None  # Lightning's own idiom
    probed.clear()
    slow_probe.cache_clear()
    cache = fit(CompiledLayer())
    assert cache._isa_probe is not None and cache._isa_probe.done.is_set() and probed.is_set()  # waited for at the end
    for _ in range(100):  # (the probe's thread puts inductor's function back just after it says it is done)
        if cpu_vec_isa.valid_vec_isa_list is slow_probe:
            break
        threading.Event().wait(0.05)
    assert cpu_vec_isa.valid_vec_isa_list is slow_probe  # the gate is gone


def test_after_an_exception_the_callbacks_after_it_run_at_once_and_the_exit_waits_for_the_isa_probe(tmp_path):
    """Review 68: on_exception waited up to 300 s for a running probe before the callbacks after it (a preemption's
    final save, inside the scheduler's grace period); the process's exit waits for it instead."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import functools, threading, time
        import torch
        from lightning.pytorch import Callback, Trainer
        from lightning.pytorch.demos.boring_classes import BoringModel
        from torch._inductor import cpu_vec_isa
        from lightning_ett import CompileCache

        @functools.cache
        def slow_probe():
            time.sleep(3.0)
            open({str(tmp_path / "probed")!r}, "w").close()
            return []

        cpu_vec_isa.valid_vec_isa_list = slow_probe

        class Failing(BoringModel):
            def __init__(self):
                super().__init__()
                self.layer = torch.compile(self.layer, backend="eager")

            def training_step(self, batch, batch_idx):
                raise RuntimeError("boom")

        class After(Callback):
            def on_exception(self, trainer, pl_module, exception):
                print(f"after {{time.time():.3f}}", flush=True)

        trainer = Trainer(accelerator="cpu", max_steps=3, callbacks=[CompileCache({str(tmp_path / "cache")!r}), After()],
                          logger=False, enable_progress_bar=False, enable_checkpointing=False,
                          enable_model_summary=False, limit_val_batches=0)
        try:
            trainer.fit(Failing())
        except RuntimeError:
            pass
    """))
    proc = run_script(str(script), timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = float(proc.stdout.split("after ")[1].split()[0])
    probed = tmp_path / "probed"
    assert probed.exists(), proc.stdout  # the exit waited for the probe ...
    assert after < probed.stat().st_mtime, proc.stdout  # ... and the callback after CompileCache did not


def test_artifacts_from_another_torch_version_are_ignored_with_a_warning(tmp_path, cold_cache):
    cache, _ = cold_cache  # (after the restart test: its bundle and inductor directory)
    good = (cache / "mega_cache.bin").read_bytes()
    info = json.loads((cache / "mega_cache.json").read_text())
    (cache / "mega_cache.json").write_text(json.dumps({**info, "torch": "1.0.0"}))
    facts, stderr = run(tmp_path, "second", cache)
    assert "CompileCache: ignoring" in stderr and "written by torch 1.0.0" in stderr
    assert facts["loaded"] == {} and facts["steps"] == 2
    # ... and set aside, then written anew although every graph came from the inductor directory.
    assert facts["cache"]["compile/fx_cache_misses"] == 0
    assert len(list(cache.glob("mega_cache.bin.corrupt-*"))) == 1
    assert json.loads((cache / "mega_cache.json").read_text())["torch"] != "1.0.0"

    # A corrupted bundle: named, set aside, rewritten; the next start loads the new one.
    (cache / "mega_cache.bin").write_bytes(good[: len(good) // 2])
    facts, stderr = run(tmp_path, "third", cache)
    assert f"ignoring the compile bundle {str(cache / 'mega_cache.bin')!r}: it is corrupted" in stderr
    assert facts["steps"] == 2 and len(list(cache.glob("mega_cache.bin.corrupt-*"))) == 2
    rewritten = (cache / "mega_cache.bin").read_bytes()
    assert rewritten != good[: len(good) // 2]
    loads = run_script("-c", "import sys, torch; info = torch.compiler.load_cache_artifacts(open(sys.argv[1], 'rb').read()); "
                       "print(sum(len(v) for v in info.artifacts.values()))", str(cache / "mega_cache.bin"),
                       TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "check-inductor"))
    assert loads.returncode == 0 and int(loads.stdout.strip()) > 0, loads.stderr[-2000:]  # the new bundle loads


def test_compile_module_compiles_the_lightning_module(tmp_path):
    facts, _ = run(tmp_path, "module", tmp_path / "cache", "--compile-module", "--backend", "aot_eager")
    assert facts["graphs"] >= 1 and facts["steps"] == 2


def test_an_unwritable_cache_dir_is_a_clear_error(tmp_path):
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    trainer = Trainer(max_steps=1, callbacks=[CompileCache(blocker / "cache")], logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    with pytest.raises(PermissionError, match=r"CompileCache\(cache_dir=.*a_file/cache'\) is not writable"):
        trainer.fit(BoringModel())


@pytest.mark.parametrize(("kwargs", "message"), [({"cache_dir": ""}, "cache_dir=''"),
                                                 ({"cache_dir": "x", "job_id": ""}, "job_id=''"),
                                                 ({"cache_dir": "x", "compile_kwargs": ["a"]}, "compile_kwargs")])
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        CompileCache(**kwargs)
