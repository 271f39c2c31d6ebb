"""Python's cyclic garbage collector kept off the training steps (ETTStrategy's ``gc_freeze``, on by default).

Why: a full (oldest-generation) collection traverses every object the process tracks. After a
Lightning + TorchRec start-up that is ~400,000 objects, ~0.2 s on a 2-core CPU host, and CPython runs
the first one a few hundred steps into training, at its own moment on each rank; the other ranks
wait for it in their next collective, so every rank's pause stalls the whole job. Measured in
``benchmarks/throughput_vs_dmp.py``'s 200-step window it was 6-12 % of the window's time (#33).

So, before the first step of a fit, every rank collects once (start-up's garbage, freed before
training rather than during it) and moves the survivors to CPython's permanent generation
(:func:`gc.freeze`): later collections traverse only what training allocates. When the fit ends
(or fails) they are unfrozen, so the rest of the program, or a later fit, collects them again.
Automatic collection stays on: garbage made during training is collected as usual.

Not Megatron-LM's ``--manual-gc`` or torchtitan's ``gc_freq`` (automatic collection off, a
collection every N steps on all ranks): that needs a cadence to choose, and garbage that reaches
the oldest generation is then not collected until the next manual full collection. Frozen
objects are still freed by reference counting; only reference cycles among them wait for the
unfreeze. :func:`gc.freeze` is process-wide: a program that freezes objects itself would see them
unfrozen at the end of the fit (``ETTStrategy(gc_freeze=False)`` leaves the collector alone).
"""

from __future__ import annotations

import gc

from lightning_ett.instrument.timeline import Phase, record_phase


class StartupObjectsFrozen:
    """Collect and freeze at a fit's start, unfreeze at its end; idempotent at both ends."""

    def __init__(self) -> None:
        self.frozen = 0  #: objects frozen at the last start (``gc.get_freeze_count()``), 0 when unfrozen

    def freeze(self) -> None:
        """Every rank, before the fit's first step. Recorded as ``other`` overhead on the ETT timeline."""
        if self.frozen:
            return
        with record_phase(Phase.OTHER):
            gc.collect()
            gc.freeze()
        self.frozen = gc.get_freeze_count()

    def unfreeze(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = 0
