"""FP8 probing: which Linear layers can run their GEMMs in FP8 (torchao's recipes) without hurting the model.

torchao is imported here first, with two loggers held at ERROR for that import only: on a CPU
machine torchao warns about each CUDA kernel library it cannot load, and torch's pytree about
an enum torchao registers; both once per process, neither actionable.
"""

from lightning_ett.instrument.quiet import loggers_at_error

with loggers_at_error("torchao", "torch.utils._pytree"):
    import torchao  # noqa: F401
