"""PT2's caches, made persistent for a job: inductor's directory, a stable job id, and the portable bundle.

The bundle (``torch.compiler.save_cache_artifacts``, PT2's "mega-cache") is what another
machine, or a wiped local disk, needs to skip compilation; the inductor directory is what
this machine reuses directly (on CPU it also holds the compiled C++ libraries, which the
bundle does not carry). A bundle that does not load — torn, garbage, another torch's — is
named in a warning, set aside, and written again after the next compile, even if every
graph then came from the inductor directory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import warnings
from pathlib import Path

import torch

from lightning_ett.compile.headers import keep_precompiled_headers
from lightning_ett.durable.files import atomic_write_bytes, atomic_write_json, set_aside
from lightning_ett.patching import Patches

log = logging.getLogger(__name__)

ARTIFACTS = "mega_cache.bin"
ARTIFACTS_INFO = "mega_cache.json"


def configure(patches: Patches, inductor_dir: Path, job_id: str, autotune_pruning: bool, batch_fusion: bool) -> None:
    """Point inductor at the persistent directory and set the knobs; ``patches`` undoes it all."""
    patches.setitem(os.environ, "TORCHINDUCTOR_CACHE_DIR", str(inductor_dir))  # read by inductor at every lookup
    keep_precompiled_headers(patches, inductor_dir / "precompiled_headers")
    patches.setattr(torch.compiler.config, "job_id", job_id)
    if autotune_pruning:
        patches.setattr(torch._inductor.config, "max_autotune_gemm_search_space", "DEFAULT")
        patches.setattr(torch._inductor.config, "autotune_local_cache", True)
    if batch_fusion:
        try:
            from torch._inductor.fx_passes.group_batch_fusion import POST_GRAD_FUSIONS, PRE_GRAD_FUSIONS
        except ImportError:
            warnings.warn("CompileCache(batch_fusion=True): this torch has no batch-fusion passes; ignored.", stacklevel=2)
            return
        patches.setattr(torch._inductor.config, "pre_grad_fusion_options", {name: {} for name in PRE_GRAD_FUSIONS})
        patches.setattr(torch._inductor.config, "post_grad_fusion_options", {name: {} for name in POST_GRAD_FUSIONS})


class Bundle:
    """The portable artifact bundle in ``cache_dir``: load it once, save it when it would change."""

    def __init__(self, cache_dir: Path) -> None:
        self.blob = cache_dir / ARTIFACTS
        self.info = cache_dir / ARTIFACTS_INFO
        self.valid_on_disk = False  # False: (re)write it at the next save, whatever compiled
        self.owner = True
        self.loaded: dict[str, int] = {}

    def load(self, owner: bool = True) -> str | None:
        """Load the bundle into PT2's caches; returns a warning to show if it was bad.

        ``owner`` (global rank 0): a bad bundle is set aside; other ranks only skip it.
        """
        self.owner = owner
        if not self.blob.is_file():
            return None
        try:
            written_by = json.loads(self.info.read_text()).get("torch")
        except (OSError, ValueError, AttributeError):
            written_by = None
        if written_by != torch.__version__:
            return self._set_aside(f"written by torch {written_by}, not {torch.__version__}")
        try:
            cache_info = torch.compiler.load_cache_artifacts(self.blob.read_bytes())
        except Exception as e:  # noqa: BLE001 - a cache must never stop training
            return self._set_aside(f"it does not load ({type(e).__name__}: {e})")
        if cache_info is None:  # torch could not deserialize it (it logged why)
            return self._set_aside("it is corrupted (torch could not deserialize it)")
        self.valid_on_disk = True
        self.loaded = _counts(cache_info)
        return None

    def _set_aside(self, why: str) -> str:
        said = f"CompileCache: ignoring the compile bundle {str(self.blob)!r}: {why}."
        if not self.owner:
            return said
        try:
            moved = [str(set_aside(path)) for path in (self.blob, self.info) if path.exists()]
        except OSError as e:  # a cache must never stop training: it stays where it is, and is ignored again next time
            return f"{said} It could not be moved aside ({e.strerror or e}); compiling from scratch."
        return f"{said} Moved aside to {moved[0]!r}; a new one is written after the next compile."

    def save(self) -> int | None:
        """Write the artifacts compiled in this process; returns the bundle's size, or ``None`` if nothing to write."""
        if self.valid_on_disk and not _compiled_anything_new():
            return None  # all cache hits: the bundle on disk already holds these artifacts
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return None
        blob, cache_info = saved
        atomic_write_bytes(self.blob, blob)
        atomic_write_json(self.info, {"torch": torch.__version__, "artifacts": _counts(cache_info)}, indent=None)
        self.valid_on_disk = True
        return len(blob)


def compile_metrics() -> dict[str, float]:
    """Where compile time went (tracing vs backend) and cache hits, from Dynamo's own counters."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    def total(key: str) -> float:
        return float(sum(compilation_time_metrics.get(key, [])))

    backend = total("OutputGraph.call_user_compiler") + total("backward._backward_impl")
    return {
        "compile/dynamo_s": max(total("_compile.compile_inner") - total("OutputGraph.call_user_compiler"), 0.0),
        "compile/backend_s": backend,
        "compile/fx_cache_hits": float(counters["inductor"]["fxgraph_cache_hit"]),
        "compile/fx_cache_misses": float(counters["inductor"]["fxgraph_cache_miss"]),
        "compile/aot_cache_hits": float(counters["aot_autograd"]["autograd_cache_hit"]),
        "compile/aot_cache_misses": float(counters["aot_autograd"]["autograd_cache_miss"]),
        # C++ compiler runs (kernels, precompiled headers, ISA probes): none on a warm CPU restart
        # but the precompiled header's preprocessing (~0.1 s), which inductor runs in every process.
        "compile/cpp_compiles": float(len(compilation_time_metrics.get("compile_file", []))),
        "compile/cpp_compile_s": total("compile_file"),
    }


#: The longest an ISA lookup waits for the background probe before it probes by itself.
GATE_TIMEOUT_S = 300.0


class IsaProbe:
    """Inductor's CPU vector-ISA probe, run in a thread from ``setup``; inductor's own ISA lookups wait for it.

    Why a thread: inductor's first CPU compile in a process checks which vector ISAs (AVX2,
    AVX-512…) work by building and loading probe libraries in ~10 subprocesses: 1 s here with
    the probe libraries already in the (persistent) inductor directory, 5 s without, paid on
    every restart even when every graph comes from the cache (no cache keeps the result: it
    describes this host). Started from ``setup`` it overlaps with the rest of start-up and with
    Dynamo's tracing of the first step; the result is ``functools.cache``-d.

    Why inductor must wait for it (issue #15: a first restart with all FX-graph and AOTAutograd
    cache hits still compiled C++ for 6-7 s): the probe is not thread-safe. To check AVX-512 BF16,
    ``VecAVX512.__bool__`` appends ``-mavx512bf16`` to the shared ISA object's ``_arch_flags``
    around a test build and then puts the old value back, and ``functools.cache`` does not stop
    two threads from running that check at once. A compile whose ``pick_vec_isa()`` ran beside
    the probe read the flags mid-check (or the two checks interleaved and left the flag in for
    good), so its C++ command line, which keys every compiled kernel and the precompiled header,
    depended on timing: the cold run built ``… -mavx512vnni -mavx512vl -mavx512bf16`` kernels, the
    first restart asked for ``… -mavx512vl`` ones, missed them all and built them again (and,
    where the host had none for that command line, a ~155 MB precompiled header: 7.5 s here);
    the second restart happened to agree with the first. Gating ``valid_vec_isa_list`` (which
    every ``pick_vec_isa()`` calls) on the probe makes every process compute the flags alone,
    the same way, so a restart finds the cold run's kernels.

    The gate takes itself away when the probe ends; a lookup waits for it at most
    :data:`GATE_TIMEOUT_S` (a hung probe must not hang a compile). Started only where a compiled
    module is found (a job that compiles nothing waited ~10 s at its end for a probe it never
    used, on 2 busy cores); a compile there has already waited for it by the end of ``fit``.
    """

    def __init__(self) -> None:
        self.done = threading.Event()
        try:
            from torch._inductor import cpu_vec_isa

            probe_isas = cpu_vec_isa.valid_vec_isa_list
        except (ImportError, AttributeError):  # another torch: no head start, inductor probes by itself
            self.done.set()
            return
        cache_info = getattr(probe_isas, "cache_info", None)
        if cache_info is not None and cache_info().currsize:  # already probed in this process
            self.done.set()
            return

        @functools.wraps(probe_isas)
        def after_probe() -> list:
            self.done.wait(GATE_TIMEOUT_S)
            return probe_isas()

        for name in ("cache_info", "cache_clear"):  # still the functools.cache it stands for
            if hasattr(probe_isas, name):
                setattr(after_probe, name, getattr(probe_isas, name))

        def probe() -> None:
            try:
                probe_isas()
            except Exception as e:  # noqa: BLE001 - only a head start: the compile will probe itself
                log.debug(f"CompileCache: background ISA probe failed ({e!r}); the first compile will probe")
            finally:
                self.done.set()
                if cpu_vec_isa.valid_vec_isa_list is after_probe:  # (a later gate wrapping it stays until its end)
                    cpu_vec_isa.valid_vec_isa_list = probe_isas

        cpu_vec_isa.valid_vec_isa_list = after_probe
        threading.Thread(target=probe, name="ett-inductor-isa-probe", daemon=True).start()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the probe; ``False`` if it is still running."""
        return self.done.wait(timeout)


def _counts(cache_info: object) -> dict[str, int]:
    """Artifacts per kind in a bundle's ``CacheInfo``."""
    return {kind: len(keys) for kind, keys in getattr(cache_info, "artifacts", {}).items()}


def _compiled_anything_new() -> bool:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_miss"] + counters["aot_autograd"]["autograd_cache_miss"] > 0


__all__ = ["ARTIFACTS", "ARTIFACTS_INFO", "Bundle", "IsaProbe", "compile_metrics", "configure"]
