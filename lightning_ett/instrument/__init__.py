"""The instrument: phase events, per-rank ledgers, the job summary and its report.

It knows nothing of Lightning, TorchRec or W&B, so ``lightning-ett report`` reads a run
without importing them; every other subsystem reports its time here.
"""
