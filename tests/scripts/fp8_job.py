"""FP8Probe on real training, for tests/test_fp8_probe.py and tests/distributed/test_fp8_probe_ranks.py.

Modes (each writes OUT/result.json, or OUT/rank<r>.json with several ranks):

* ``probe``: ``--model`` (the planted-outlier MLP of examples/fp8_outliers.py, or the example DLRM
  in one process) trained for ``--steps`` in each fit of ``--arms`` (``probe``: with ``FP8Probe``;
  ``none``: without; same data): training-loop times, the probe's results and overhead, the
  layers its ``module_filter_fn`` selects and those torchao's ``convert_to_float8_training``
  converts with it; ``--run-dir`` adds ETTMonitor, ``--wandb-dir`` a WandbLogger (offline).
* ``train``: the same model trained under ``--precision`` once per ``--train-arms``, with torchao's
  ``convert_to_float8_training`` (the real FP8 training; ``--emulate``: this package's
  emulation instead) on no layer, on the layers a probe run found safe (``--results``), on all,
  or on the planted layer alone; then each one's loss on 16 unseen batches.
* ``dlrm``: the example DLRM under ETTStrategy on ``--devices`` gloo ranks with FP8Probe; every
  rank writes the probe's results and its own windows.
* ``user``: a new user's model (:class:`UserModel`: a frozen projection fed raw features with
  outlier channels, layers built in ``configure_model``) under ``--precision`` and ``--strategy``
  on ``--devices`` ranks; every rank writes the results and its own windows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn

from examples.fp8_outliers import OutlierBatches, OutlierData, OutlierMLP
from lightning_ett import ETTMonitor, FP8Probe, emulate_float8_training

OUTLIER_SCALE, DATA_SEED, BATCH_SIZE = 1e5, 0, 256  # --outlier-scale, --seed, --batch-size


def make(name: str) -> tuple[Any, Any]:
    """A fresh model and its data: the planted-outlier MLP, or the example DLRM (one process, tables unsharded)."""
    if name == "planted":
        return OutlierMLP(), OutlierData(batch_size=BATCH_SIZE, outlier_scale=OUTLIER_SCALE, seed=DATA_SEED)
    from examples.dlrm_example import DLRMModule, RandomCriteoDataModule

    return DLRMModule(num_embeddings=5000), RandomCriteoDataModule(batch_size=512, num_embeddings=5000)


def held_out_loss(name: str, model: Any) -> float:
    """The loss on 16 batches never trained on."""
    if name == "planted":
        batches = (OutlierBatches(batch_size=256, outlier_scale=OUTLIER_SCALE, seed=99, rank=0).batch(i) for i in range(16))
        with torch.no_grad():
            losses = [float(nn.functional.mse_loss(model(x), y)) for x, y in batches]
        return sum(losses) / len(losses)
    from examples.dlrm_example import RandomCriteoDataModule

    data = RandomCriteoDataModule(batch_size=512, num_embeddings=5000, num_val_batches=16, seed=99)
    with torch.no_grad():
        losses = [float(model.loss(model(b), b.labels.float())) for b in data._dataset(16, 99)]
    return sum(losses) / len(losses)


PRECISION = "32-true"  # --precision


def trainer(steps: int, callbacks: list[Any], loggers: Any = False, **kw: Any) -> Trainer:
    return Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=loggers, callbacks=callbacks, precision=PRECISION,
                   enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kw)


class LoopTimer(Callback):
    """The training loop's time, from its first step to its end (start-up and the end-of-fit reports excluded),
    and each step's."""

    def __init__(self) -> None:
        self.start = self.seconds = self._step_start = 0.0
        self.step_s: list[float] = []

    def on_train_start(self, *args: Any) -> None:
        self.start = time.perf_counter()

    def on_train_batch_start(self, *args: Any) -> None:
        self._step_start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.step_s.append(time.perf_counter() - self._step_start)

    def on_train_end(self, *args: Any) -> None:
        self.seconds = time.perf_counter() - self.start


def time_hooks(fp8_probe: FP8Probe) -> list[float]:
    """Time the probe's two per-step hooks in place (both, every step): a list the fit fills, one entry per step."""
    per_step: list[float] = []
    start_hook, end_hook = fp8_probe.on_train_batch_start, fp8_probe.on_train_batch_end

    def on_start(*a: Any, **k: Any) -> None:
        began = time.perf_counter()
        start_hook(*a, **k)
        per_step.append(time.perf_counter() - began)

    def on_end(*a: Any, **k: Any) -> None:
        began = time.perf_counter()
        end_hook(*a, **k)
        per_step[-1] += time.perf_counter() - began

    fp8_probe.on_train_batch_start, fp8_probe.on_train_batch_end = on_start, on_end  # type: ignore[method-assign]
    return per_step


def timed_fit(steps: int, callbacks: list[Any], model: Any, data: Any, loggers: Any = False) -> LoopTimer:
    timer = LoopTimer()
    trainer(steps, [timer, *callbacks], loggers).fit(model, datamodule=data)  # its step clock starts first
    return timer


def agreement(model: Any, recipe: str) -> dict[str, dict[str, list[float]]]:
    """Per Linear of the trained planted model, on a held-out batch under the run's precision: each GEMM's SQNR as the
    probe predicts it and as torchao's own Float8Linear (a converted copy of the layer, the same weights) gives it,
    from the same input and the same output gradient."""
    from tests.helpers.fp8_agreement import against_torchao

    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(PRECISION)
    x_batch, _ = OutlierBatches(batch_size=256, outlier_scale=OUTLIER_SCALE, seed=98, rank=0).batch(0)
    inputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, a, o, fqn=fqn: inputs.__setitem__(fqn, a[0].detach()))
               for fqn, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        model(x_batch)
    for handle in handles:
        handle.remove()
    out: dict[str, dict[str, list[float]]] = {}
    for fqn, layer in model.named_modules():
        if isinstance(layer, nn.Linear):
            grad = torch.randn(inputs[fqn].shape[0], layer.out_features, generator=torch.Generator().manual_seed(0)) * 1e-3
            found = against_torchao(layer, inputs[fqn].float(), grad, recipe, autocast)
            out[fqn] = {g: [found.predicted[g], found.measured[g]] for g in found.predicted}
    return out


def probe(args: argparse.Namespace) -> dict[str, Any]:
    """The fits of ``--arms`` (``probe``: with ``FP8Probe(**--probe-args)``; ``none``: without), in that order, on the
    same model, seed and data; ``--run-dir``/``--wandb-dir``: for the probed fit."""
    loops: list[float] = []
    fp8_probe = hook_s = with_probe = model = None
    for arm in args.arms.split(","):
        seed_everything(0, verbose=False)
        if arm == "none":
            loops.append(timed_fit(args.steps, [], *make(args.model)).seconds)
            continue
        fp8_probe = FP8Probe(**json.loads(args.probe_args))
        hook_s = time_hooks(fp8_probe)
        callbacks: list[Any] = [fp8_probe]
        loggers: Any = False
        if args.run_dir:
            callbacks.append(ETTMonitor(run_dir=args.run_dir, report_on_end=False))
        if args.wandb_dir:
            from lightning.pytorch.loggers import WandbLogger

            loggers = [WandbLogger(project="fp8-test", save_dir=args.wandb_dir, offline=True)]
        model, data = make(args.model)
        with_probe = timed_fit(args.steps, callbacks, model, data, loggers)
        loops.append(with_probe.seconds)
    if fp8_probe is None or with_probe is None:
        return {"arms": args.arms.split(","), "loop_s": loops}
    selected = [fqn for fqn, m in model.named_modules() if fp8_probe.module_filter_fn()(m, fqn)]
    from torchao.float8 import convert_to_float8_training

    converted = convert_to_float8_training(make(args.model)[0], module_filter_fn=fp8_probe.module_filter_fn())
    return {"arms": args.arms.split(","), "loop_s": loops, "results": fp8_probe.results, "overhead": fp8_probe.overhead,
            "samples_taken": fp8_probe.samples_taken, "step_s_with": with_probe.step_s,
            "sampled_steps": fp8_probe.sampled_steps, "hook_s": hook_s, "selected": selected,
            "summary_line": fp8_probe.summary_line(),
            "agreement": agreement(model, fp8_probe.recipe) if args.model == "planted" else None,
            "converted": sorted(fqn for fqn, m in converted.named_modules() if type(m).__name__ == "Float8Linear")}


def train(args: argparse.Namespace) -> dict[str, Any]:
    """The same model, seed and data with FP8 (torchao's, or emulated) on no layer, on the probe's safe layers, and on all."""
    results = json.loads(Path(args.results).read_text())["results"] if args.results else {}
    safe = {fqn for fqn, r in results.items() if r["verdict"] == "safe"}
    filters: dict[str, Any] = {"none": lambda m, fqn: False, "safe": lambda m, fqn: fqn in safe,
                               "all": lambda m, fqn: True, "planted": lambda m, fqn: fqn == "planted"}
    out: dict[str, Any] = {}
    for name in args.train_arms.split(","):
        module_filter = filters[name]
        seed_everything(0, verbose=False)
        model, data = make(args.model)
        if args.emulate:
            swapped = emulate_float8_training(model, module_filter)
        else:
            from torchao.float8 import convert_to_float8_training

            convert_to_float8_training(model, module_filter_fn=module_filter)
            swapped = [fqn for fqn, m in model.named_modules() if type(m).__name__ == "Float8Linear"]
        trainer(args.steps, []).fit(model, datamodule=data)
        out[name] = {"swapped": swapped, "held_out_loss": held_out_loss(args.model, model),
                     "fp8": "emulated" if args.emulate else "torchao"}
    return out


class RawFeatures(torch.utils.data.IterableDataset):
    """Raw features, two of them outlier channels (an id, a timestamp: ~3e4), and a target from the others."""

    def __init__(self, rank: int, batch_size: int = 256) -> None:
        self.rank, self.batch_size = rank, batch_size

    def __iter__(self):  # type: ignore[no-untyped-def]
        g = torch.Generator().manual_seed(100 + self.rank)
        while True:
            x = torch.randn(self.batch_size, 32, generator=g)
            x[:, :2] = 3e4 * (1 + 0.1 * x[:, :2])
            yield x, x[:, 2:6].sum(dim=1, keepdim=True)


class UserModel(LightningModule):
    """A frozen projection (its own weights for the outlier channels are not zero) and a head built in configure_model."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 64).requires_grad_(False)
        self.body: nn.Module | None = None

    def configure_model(self) -> None:
        if self.body is None:
            self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.proj(x) / 1e4)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x).float(), y)

    def train_dataloader(self) -> Any:
        return torch.utils.data.DataLoader(RawFeatures(self.global_rank), batch_size=None)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)


def user(args: argparse.Namespace) -> None:
    seed_everything(0, verbose=False)
    fp8_probe = FP8Probe(**json.loads(args.probe_args))
    strategy: Any = args.strategy
    if strategy == "ett":
        from lightning_ett import ETTStrategy

        strategy = ETTStrategy()
    t = Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, precision=args.precision,
                max_steps=args.steps, logger=False, callbacks=[fp8_probe], enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(args.out))
    t.fit(UserModel(), ckpt_path=args.resume)
    if args.save:
        t.save_checkpoint(args.save)  # (every rank, as Lightning asks)
    write_rank(args.out, t.global_rank, fp8_probe)


def write_rank(out: Path, rank: int, fp8_probe: FP8Probe, **extra: Any) -> None:
    """This rank's view: the combined results, its own windows, and the test's parameters."""
    record = {"results": fp8_probe.results, "windows": {f: sorted(r.windows.items()) for f, r in fp8_probe._records.items()},
              "threshold": fp8_probe.sqnr_threshold_db, "tail": fp8_probe.tail, "confidence": fp8_probe.confidence,
              "samples_taken": fp8_probe.samples_taken, **extra}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def dlrm(args: argparse.Namespace) -> None:
    from torchrec.datasets.criteo import DEFAULT_INT_NAMES

    from examples.dlrm_example import DLRMModule, RandomCriteoDataModule
    from lightning_ett import ETTStrategy

    seed_everything(0, verbose=False)
    fp8_probe = FP8Probe(every_n_steps=5, max_overhead=0.5)
    t = Trainer(accelerator="cpu", devices=args.devices, strategy=ETTStrategy(sharding_type="table_wise"),
                max_steps=args.steps, logger=False, callbacks=[fp8_probe, ETTMonitor(run_dir=args.run_dir, report_on_end=False)],
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                num_sanity_val_steps=0)
    model = DLRMModule(num_embeddings=1000, embedding_dim=16, dense_arch_layer_sizes=[64, 16],
                       over_arch_layer_sizes=[64, 32, 1])
    t.fit(model, datamodule=RandomCriteoDataModule(batch_size=128, num_embeddings=1000, num_train_batches=args.steps + 5))
    write_rank(args.out, t.global_rank, fp8_probe, dense=len(DEFAULT_INT_NAMES))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["probe", "train", "dlrm", "user"])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--results", default=None)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--wandb-dir", default=None)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--probe-args", default="{}", help="JSON keyword arguments of FP8Probe (probe mode)")
    p.add_argument("--arms", default="probe", help="probe mode: the fits, in order: probe (with FP8Probe), none")
    p.add_argument("--train-arms", default="none,safe,all", help="train mode: FP8 on none, safe, all or planted")
    p.add_argument("--model", choices=["planted", "dlrm"], default="planted")
    p.add_argument("--precision", default="32-true")
    p.add_argument("--strategy", default="auto")
    p.add_argument("--save", default=None, help="user mode: a checkpoint to save after fit")
    p.add_argument("--resume", default=None, help="user mode: the checkpoint to resume from")
    p.add_argument("--emulate", action="store_true", help="train mode: this package's FP8 emulation, not torchao's")
    p.add_argument("--outlier-scale", type=float, default=1e5, help="the planted model's outlier features")
    p.add_argument("--seed", type=int, default=0, help="the planted model's data")
    p.add_argument("--batch-size", type=int, default=256, help="the planted model's training batches")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global PRECISION, OUTLIER_SCALE, DATA_SEED, BATCH_SIZE
    PRECISION, OUTLIER_SCALE, DATA_SEED, BATCH_SIZE = args.precision, args.outlier_scale, args.seed, args.batch_size
    if args.mode in ("dlrm", "user"):
        (dlrm if args.mode == "dlrm" else user)(args)
        return
    result = probe(args) if args.mode == "probe" else train(args)
    (args.out / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
