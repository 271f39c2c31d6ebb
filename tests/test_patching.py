"""One way to patch what we do not own, and to take it back."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from conftest import clean_env

from lightning_ett.patching import Patches


class Connector:
    def resume_start(self) -> str:
        return "lightning's"


def test_an_instance_patch_lets_the_class_method_show_through_again():
    connector, other = Connector(), Connector()
    patches = Patches()
    patches.setattr(connector, "resume_start", lambda: "ours")
    assert connector.resume_start() == "ours" and other.resume_start() == "lightning's"
    patches.undo()
    assert "resume_start" not in vars(connector) and connector.resume_start() == "lightning's"
    patches.undo()  # idempotent


def test_module_config_and_environment_patches_are_restored_in_reverse_order(monkeypatch):
    job_id, space = torch.compiler.config.job_id, torch._inductor.config.max_autotune_gemm_search_space
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # (inductor may set it when first imported)
    with Patches() as patches:
        patches.setitem(os.environ, "TORCHINDUCTOR_CACHE_DIR", "/cache")
        patches.setattr(torch.compiler.config, "job_id", "ours")
        patches.setattr(torch.compiler.config, "job_id", "ours again")
        patches.setattr(torch._inductor.config, "max_autotune_gemm_search_space", "EXHAUSTIVE")
        assert torch.compiler.config.job_id == "ours again" and os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/cache"
        assert len(patches) == 4
    assert torch.compiler.config.job_id == job_id and torch._inductor.config.max_autotune_gemm_search_space == space
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_importing_the_package_changes_no_warning_filter_nor_torch_serialization_option():
    code = """
import warnings, torch, torch.serialization as s
import lightning.pytorch, torchrec
before = (list(warnings.filters), s.get_crc32_options, s.get_crc32_options(), s.get_default_load_endianness(),
          s.get_default_mmap_options())
import lightning_ett
from lightning_ett import AsyncCheckpoint, CompileCache, DynamicShapes, ETTMonitor, ETTStrategy, ModelPublisher
import lightning_ett.launch.cli, lightning_ett.launch.launcher, lightning_ett.publish.worker, lightning_ett.checkpoint.writer
import lightning_ett.checkpoint.sharded, lightning_ett.compile.cache, lightning_ett.checkpoint.adopt
after = (list(warnings.filters), s.get_crc32_options, s.get_crc32_options(), s.get_default_load_endianness(),
         s.get_default_mmap_options())
assert before == after, (before, after)
print("unchanged")
"""
    proc = subprocess.run([sys.executable, "-c", code], check=False, env=clean_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "unchanged", proc.stderr[-2000:]
