"""FP8 probing: which Linear layers can run their GEMMs in FP8 (torchao's recipes) without hurting the model.

torchao is imported here first, with two loggers held at ERROR for that import only: on a CPU
machine torchao warns about each CUDA kernel library it cannot load, and torch's pytree about
an enum torchao registers; both once per process, neither actionable.
"""

import logging

_quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
_levels = [logger.level for logger in _quiet]
for _logger in _quiet:
    _logger.setLevel(logging.ERROR)
try:
    import torchao  # noqa: F401
finally:
    for _logger, _level in zip(_quiet, _levels):
        _logger.setLevel(_level)
