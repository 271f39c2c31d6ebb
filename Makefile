# The one install path (README, tests, CI): a venv with the exact set in requirements/cpu.txt.
# --no-deps because torchrec declares the CUDA-only `fbgemm-gpu`; cpu.txt lists every real
# dependency instead, with `fbgemm-gpu-cpu` in its place.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lightning-ett-installed

.PHONY: install example test bench clean

install: $(STAMP)

# The last two steps are what a first run would otherwise pay in every process: the package's
# bytecode (an editable install compiles none; under PYTHONDONTWRITEBYTECODE every process
# recompiles it) and matplotlib's font cache (the first report's PNG).
$(STAMP): requirements/cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --no-deps -r requirements/cpu.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, fbgemm_gpu, torchrec, lightning, wandb, torchao, sklearn; print('lightning-ett env ok: torch', torch.__version__)"
	$(PY) -m compileall -q lightning_ett examples tests benchmarks > /dev/null
	$(PY) -c "import matplotlib.font_manager"
	touch $(STAMP)

# Main job: the TorchRec DLRM example on 2 CPU processes (gloo), W&B offline unless WANDB_API_KEY is set.
# Starts fresh: AsyncCheckpoint would otherwise resume from the previous run's last checkpoint.
example: install
	rm -rf ett_runs/dlrm-example/checkpoints
	$(VENV)/bin/lightning run --devices 2 examples/dlrm_example.py fit --config examples/dlrm.yaml

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q tests --durations=10

bench: install
	$(PY) benchmarks/monitor_overhead.py

clean:
	rm -rf $(VENV) ett_runs lightning_logs wandb
