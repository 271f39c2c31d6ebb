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


class Base:
    @staticmethod
    def build() -> str:
        return "base"

    @property
    def size(self) -> int:
        return self._size

    @size.setter
    def size(self, value: int) -> None:
        self._size = value


class Derived(Base):
    pass


def test_class_attributes_inherited_ones_and_properties_come_back_as_they_were():
    derived, sized = Derived(), Base()
    sized.size = 3
    with Patches() as patches:
        patches.setattr(Base, "build", staticmethod(lambda: "ours"))  # a class's own staticmethod
        patches.setattr(Derived, "extra", 1)
        patches.setattr(Derived, "build", staticmethod(lambda: "derived"))  # inherited: deleted on undo
        patches.setattr(sized, "size", 7)  # a property: read, and set back
        assert Base.build() == "ours" and derived.build() == "derived" and sized.size == 7
    assert Base.build() == "base" and derived.build() == "base" and "build" not in vars(Derived)
    assert not hasattr(Derived, "extra") and isinstance(vars(Base)["build"], staticmethod) and sized.size == 3


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
