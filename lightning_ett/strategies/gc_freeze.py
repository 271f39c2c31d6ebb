"""Start-up's Python objects kept out of the garbage collector's way during training (ETTStrategy's ``gc_freeze``).

Why: a full (oldest-generation) collection traverses every object the process tracks. After a
Lightning + TorchRec start-up that is ~400,000 objects, ~0.2 s on a 2-core CPU host, and CPython runs
the first one a few hundred steps into training, at its own moment on each rank; the other ranks
wait for it in their next collective, so every rank's pause stalls the whole job. In
``benchmarks/throughput_vs_dmp.py``'s 200-step window that pause fell in ETTStrategy's arm and not in
TorchRec's loops' (#33, ``benchmarks/README.md``).

So, before the first step of a fit, every rank collects once (start-up's garbage is freed before
training rather than during it) and moves the survivors to CPython's permanent generation
(:func:`gc.freeze`): no later collection traverses them. What training allocates (compiled graphs,
optimizer state made at the first step, per-batch objects) is collected as usual, automatic
collection stays on, and the objects are unfrozen at the fit's teardown or when it fails, so the rest
of the program collects them again.

Frozen objects are still freed by reference counting. A reference cycle that includes a frozen
object (also one joined by an object made during training) is not collected until the unfreeze.
:func:`gc.freeze` is process-wide, so a freeze already in place (the program's own, say before
forking workers, or an outer fit's) is left alone and not undone here, and so is a freeze made during the fit
(the start-up objects then stay frozen too). A program that turned automatic collection off
(:func:`gc.disable`) is left alone: it has no automatic full collection to keep away.

Not Megatron-LM's ``--manual-gc`` or torchtitan's ``gc_freq`` (automatic collection off, a
collection every N steps on all ranks): that needs a cadence to choose, and garbage in the
oldest generation then waits for the next manual full collection.
"""

from __future__ import annotations

import gc
import time

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_ett.instrument.timeline import GC_FREEZE_FACT, Phase, get_timeline, record_phase


class StartupObjectsFrozen:
    """Collect and freeze at a fit's first training start, unfreeze at its teardown or failure: only a freeze
    made here is undone here.

    Unfrozen at ``teardown``, not ``on_train_end``: a fit runs the fit loop (``on_train_start`` ...
    ``on_train_end``) more than once inside itself when Lightning's LR finder is called from a callback or
    BatchSizeFinder tries sizes, and nothing trains between the last ``on_train_end`` and ``teardown``."""

    def __init__(self) -> None:
        self.owns_freeze = False  #: this object froze, and has not unfrozen yet
        self.frozen = 0  #: objects frozen by the last freeze made here
        self._probe: list[object] | None = None  #: made right after our freeze: frozen only by a later freeze
        self._said: set[str] = set()

    def freeze(self) -> None:
        """Every rank, before the fit's first step. Recorded as ``other`` overhead on the ETT timeline."""
        if self.owns_freeze:
            return
        if not gc.isenabled():  # the program collects when it chooses: no automatic full collection to keep away
            self._say_once("off", "automatic garbage collection is off (gc.disable); the collector is left as it is.")
            return
        if gc.get_freeze_count():
            self._say_once("frozen", f"{gc.get_freeze_count()} objects are frozen already (gc.freeze); the "
                                     "collector is left as it is.")
            return
        start = time.perf_counter()
        with record_phase(Phase.OTHER):
            self.owns_freeze = True  # before the freeze: an interrupt right after it still finds it owned
            self._probe = None
            gc.collect()
            gc.freeze()
            self._probe = []  # tracked, in the youngest generation: moved to the permanent one only by another freeze
            self.frozen = gc.get_freeze_count()
        get_timeline().fact(GC_FREEZE_FACT, objects=self.frozen, seconds=round(time.perf_counter() - start, 4))

    def unfreeze(self) -> None:
        """The fit is over or failed. Cannot raise; idempotent. If someone froze objects since our freeze (the probe
        is no longer among the collector's generations), theirs is kept, and so ours."""
        if not self.owns_freeze:
            return
        self.owns_freeze = False
        probe, self._probe = self._probe, None
        if probe is not None and not any(obj is probe for obj in gc.get_objects()):
            self._say_once("kept", "objects were frozen (gc.freeze) during the fit; they are left frozen.")
            return
        gc.unfreeze()

    def _say_once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            rank_zero_info(f"ETTStrategy(gc_freeze=True): {message}")
