"""ModelPublisher: serving snapshots from AsyncCheckpoint's durable checkpoints, off the training path."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ett.callbacks.checkpoint import AsyncCheckpoint
from lightning_ett.callbacks.collectives import any_rank
from lightning_ett.callbacks.directory_owner import own_directory
from lightning_ett.callbacks.loggers import log_to_loggers
from lightning_ett.checkpoint.layout import PIN_FILE
from lightning_ett.durable.errors import ConfigurationError, ConfigurationTypeError, check_full_every
from lightning_ett.durable.files import writable_dir_error
from lightning_ett.durable.ownership import PUBLISHER_OWNER_FILE, OwnerLock
from lightning_ett.instrument.timeline import PUBLISH_ERROR_FACT, PUBLISH_FACT, Phase, get_timeline, record_phase
from lightning_ett.patching import Patches
from lightning_ett.publish.artifact import PublishRequest
from lightning_ett.publish.process import PublisherProcess

#: Metric names that need no torchmetrics object: the training loss at the saved step (mean over ranks), the epoch.
BUILTIN_METRICS = ("loss", "epoch")


class ModelPublishError(RuntimeError):
    """Publishing failed (raised at the end of ``fit`` only with ``ModelPublisher(strict=True)``)."""


class ModelPublisher(Callback):
    r"""Publish each durable checkpoint of :class:`~lightning_ett.AsyncCheckpoint` as a serving artifact.

    No second snapshot: when AsyncCheckpoint has committed a checkpoint, the training thread
    only tells a separate publisher process about it (the ETT ``publish`` phase: a pipe write
    and a pin file). That process reads the checkpoint's model weights — whole, sharded tables
    gathered by DCP, no optimizer state — and writes ``<dirpath>/v<N>/model.pt`` with a
    ``manifest.json`` (version, global step, time, source checkpoint, ``metrics``), then
    replaces ``<dirpath>/latest`` atomically. See :mod:`lightning_ett.publish.artifact` for the format;
    a server loads it with ``torch.load(..., weights_only=True)`` into the plain model.

    If the publisher lags, it publishes the newest committed checkpoint and skips older
    ones. A failure (unwritable target, crashed process, unreadable checkpoint) never stops
    training: it is logged, counted in ``publish/errors``, stated in the ETT report, and
    raised as :class:`ModelPublishError` at the end of ``fit`` when ``strict``.

    Args:
        dirpath: the publish directory (created; must be writable — checked before the first step).
        keep_last_n: versions to keep (``None``: all); the newest is never deleted.
        metrics: values recorded in each manifest, taken at the checkpoint's step: names of
            ``torchmetrics.Metric`` attributes of the LightningModule (dotted paths, e.g.
            ``"val_auroc"`` or ``"metrics.ne"``; ``compute()``\d over all ranks if updated since
            its last reset, else the value its last ``compute()`` returned, e.g. at the end of the
            last validation) or ``"loss"`` / ``"epoch"`` (``loss``: what ``training_step`` returned
            for the saved step's last batch, mean over ranks; under gradient accumulation Lightning
            has divided it by the number of batches). Names logged with ``self.log`` are not
            known before they are logged, so they cannot be checked before the first step; name
            the Metric object instead. Every name is in every manifest: ``null`` for a checkpoint saved
            before a restart (its step's values were not taken in this process).
        submodule: publish only this submodule's weights, named relative to it (e.g.
            ``"model"``: the DLRM inside the LightningModule); default: the whole LightningModule.
        strict: raise :class:`ModelPublishError` at the end of ``fit`` if any publish failed.
        wait_on_end: at the end of ``fit``, wait (as ``publish``) until the last checkpoint is published.
        checkpoint_dirpath: which AsyncCheckpoint to follow, when the Trainer has several.
        end_timeout_s: the longest that wait lasts (rank 0 waits; with ``strict`` the other ranks
            wait for its verdict in a collective, so keep it below the process group's timeout).
        deltas: between full versions, publish only the rows of each table that changed since
            the version before (``delta.pt``; every other tensor whole), which a server holding
            that version applies with :func:`lightning_ett.publish.artifact.apply_published_delta`
            (torch only); :func:`~lightning_ett.publish.artifact.load_published` rebuilds any
            version. The publisher process then holds the newest version's weights (one more
            copy of the model in host RAM) to compare with. A new full version is written once
            a chain's deltas add up to half a full version, after a restart, or when another
            job published meanwhile.
        full_every_n_versions: with ``deltas``: every N-th version is full (``None``: by the chain's size).
    """

    def __init__(
        self,
        dirpath: str | Path,
        keep_last_n: int | None = 5,
        metrics: Sequence[str] = (),
        submodule: str | None = None,
        strict: bool = False,
        wait_on_end: bool = True,
        checkpoint_dirpath: str | Path | None = None,
        end_timeout_s: float = 300.0,
        deltas: bool = False,
        full_every_n_versions: int | None = None,
    ) -> None:
        if not isinstance(dirpath, (str, Path)) or not str(dirpath):
            raise ConfigurationTypeError(f"ModelPublisher(dirpath={dirpath!r}): expected a directory path (str or Path).")
        if keep_last_n is not None and (not isinstance(keep_last_n, int) or isinstance(keep_last_n, bool) or keep_last_n < 1):
            raise ConfigurationError(f"ModelPublisher(keep_last_n={keep_last_n!r}): expected an int >= 1, or None to keep all.")
        if isinstance(metrics, str) or not all(isinstance(m, str) and m for m in metrics):
            raise ConfigurationTypeError(
                f"ModelPublisher(metrics={metrics!r}): expected a list of metric names, e.g. ['val_auroc'].")
        if len(set(metrics)) != len(metrics):
            raise ConfigurationError(f"ModelPublisher(metrics={list(metrics)!r}): a name is repeated.")
        if submodule is not None and (not isinstance(submodule, str) or not submodule):
            raise ConfigurationError(
                f"ModelPublisher(submodule={submodule!r}): expected an attribute path such as 'model', or None.")
        if not end_timeout_s > 0:
            raise ConfigurationError(f"ModelPublisher(end_timeout_s={end_timeout_s!r}): expected a number of seconds > 0.")
        if not isinstance(deltas, bool):
            raise ConfigurationTypeError(f"ModelPublisher(deltas={deltas!r}): expected True or False.")
        check_full_every("ModelPublisher", "full_every_n_versions", full_every_n_versions, "deltas", deltas, "version")
        self.dirpath = Path(dirpath)
        self.keep_last_n = keep_last_n
        self.metrics = list(metrics)
        self.submodule = submodule
        self.strict = strict
        self.wait_on_end = wait_on_end
        self.checkpoint_dirpath = Path(checkpoint_dirpath).absolute() if checkpoint_dirpath is not None else None
        self.end_timeout_s = float(end_timeout_s)
        self.deltas = deltas
        self.full_every_n_versions = full_every_n_versions
        # resumable state
        self.published = 0
        self.last_published_step = -1
        self.last_version: int | None = None
        # per-fit state (rank 0 runs the process)
        self.errors: list[str] = []
        self._checkpoint: AsyncCheckpoint | None = None
        self._process: PublisherProcess | None = None
        self._owner: OwnerLock | None = None  # rank 0, during fit: this job owns dirpath
        self._pending: PublishRequest | None = None
        self._metrics_at: dict[int, dict[str, float | None]] = {}
        self._last_loss: tuple[int, torch.Tensor] | None = None
        self._last_computed: dict[str, float] = {}
        self._metric_objects: dict[str, Any] = {}  # name -> torchmetrics.Metric, resolved before the first step
        self._patches = Patches()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self.dirpath))

    # ------------------------------------------------------------------ set-up: every check before the first step
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self.dirpath = self.dirpath.absolute()
        self._checkpoint = self._find_checkpoint(trainer)
        self._checkpoint.add_listener(self)
        self.errors = []
        self._metrics_at.clear()
        self._last_computed.clear()

    def _find_checkpoint(self, trainer: pl.Trainer) -> AsyncCheckpoint:
        found = [cb for cb in trainer.callbacks if isinstance(cb, AsyncCheckpoint)]
        if self.checkpoint_dirpath is not None:
            found = [cb for cb in found if Path(cb.dirpath).absolute() == self.checkpoint_dirpath]
        if len(found) == 1:
            return found[0]
        if not found:
            which = f" with dirpath {str(self.checkpoint_dirpath)!r}" if self.checkpoint_dirpath else ""
            raise ConfigurationError(f"ModelPublisher publishes the checkpoints AsyncCheckpoint writes, but the Trainer has no "
                                     f"AsyncCheckpoint{which}. Add AsyncCheckpoint(dirpath=..., every_n_train_steps=...) to "
                                     "Trainer(callbacks=[...]).")
        raise ConfigurationError("ModelPublisher: the Trainer has several AsyncCheckpoint callbacks; pass "
                                 "ModelPublisher(checkpoint_dirpath=...) to choose the one to publish from.")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check names against the built model (after ``configure_model``), the directory on rank 0."""
        self._metric_objects = {name: _resolve_metric(pl_module, name)  # the same on every rank: every rank raises
                                for name in self.metrics if name not in BUILTIN_METRICS}
        for name, metric in self._metric_objects.items():
            self._remember_computed(name, metric)
        if self.submodule is not None:
            try:
                pl_module.get_submodule(self.submodule)
            except AttributeError:
                raise ConfigurationError(
                    f"ModelPublisher(submodule={self.submodule!r}): {type(pl_module).__name__} has no such "
                    "submodule; pass the attribute path of the model to serve, e.g. 'model', or None.") from None
        error = writable_dir_error(self.dirpath, "ModelPublisher(dirpath") if trainer.is_global_zero else None
        said = trainer.strategy.broadcast(str(error) if error else None, src=0)
        if said is not None:
            raise PermissionError(said)
        # Two jobs publishing here would interleave their versions: a server would see steps go back and forth.
        self._owner = own_directory(
            trainer, self.dirpath, PUBLISHER_OWNER_FILE, "ModelPublisher",
            fix="Stop that job first, or give this one a publish dirpath of its own.", on_takeover=rank_zero_warn,
            held=self._owner)
        if trainer.is_global_zero:
            self._process = PublisherProcess(self.dirpath, self.keep_last_n)
            self._process.start()  # imports torch in the background, ready for the first checkpoint

    def _remember_computed(self, name: str, metric: Any) -> None:
        """Keep the last value ``metric.compute()`` returned: a validation metric is reset after its
        epoch, so at a checkpoint's step its value is the one the last validation computed."""
        original = metric.compute

        def compute(*args: Any, **kwargs: Any) -> Any:
            value = original(*args, **kwargs)
            if isinstance(value, torch.Tensor) and value.numel():
                self._last_computed[name] = float(value.detach().float().mean())
            return value

        self._patches.setattr(metric, "compute", compute)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """After a restart, publish the checkpoint training resumed from if it is newer than what was published."""
        resumed = trainer.ckpt_path
        if trainer.is_global_zero and resumed and self._checkpoint is not None \
                and Path(resumed).parent.absolute() == Path(self._checkpoint.dirpath).absolute() \
                and trainer.global_step > self.last_published_step:
            # The process skips it if it is the newest version's source already.
            self.on_checkpoint_durable(trainer, Path(resumed).absolute(), trainer.global_step)

    # ------------------------------------------------------------------ training: notifications only
    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if "loss" in self.metrics:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                self._last_loss = (trainer.global_step, loss.detach())  # no .item(): no device sync per step
        if self._process is not None:
            self._collect(trainer, self._process.poll())
            self._dispatch(trainer)

    def on_checkpoint_snapshot(self, trainer: pl.Trainer, step: int) -> None:
        """Every rank at the saved step: take the named metrics (collectives, so every rank joins)."""
        if not self.metrics:
            return
        with record_phase(Phase.PUBLISH, step):
            values = self._metric_values(trainer, step)
        if trainer.is_global_zero:
            self._metrics_at[step] = values
            for old in sorted(self._metrics_at)[:-8]:
                del self._metrics_at[old]

    def on_checkpoint_durable(self, trainer: pl.Trainer, path: Path, step: int) -> None:
        """Rank 0: a checkpoint is committed. Queue it; the process gets it as soon as it is idle."""
        if self._process is None:
            return
        with record_phase(Phase.PUBLISH, step):
            try:
                (path / PIN_FILE).touch()
            except OSError as e:
                self._failed(trainer, step, f"cannot pin checkpoint {str(path)!r} for publishing: {e!r}")
                return
            if self._pending is not None:
                self._release(Path(self._pending.source))  # superseded before it was started: newest wins
            # Numbered above this job's last version, even if the directory was emptied meanwhile.
            values = self._metrics_at.pop(step, dict.fromkeys(self.metrics))  # (saved before a restart: null)
            self._pending = PublishRequest(str(path), step, values, self.submodule,
                                           after_version=self.last_version or 0, deltas=self.deltas,
                                           full_every_n_versions=self.full_every_n_versions)
            self._dispatch(trainer)

    def _dispatch(self, trainer: pl.Trainer) -> None:
        assert self._process is not None
        if self._pending is None or self._process.in_flight is not None:
            return
        request, self._pending = self._pending, None
        try:
            self._process.send(request)
        except OSError as e:
            self._release(Path(request.source))
            self._failed(trainer, request.step, f"could not hand checkpoint {request.source!r} to the publisher process: {e!r}")

    def _collect(self, trainer: pl.Trainer, answers: list[dict[str, Any]]) -> None:
        for answer in answers:
            step = answer.get("step")
            if answer.get("request_source"):
                self._release(Path(answer["request_source"]))
            if not answer.get("ok"):
                self._failed(trainer, step, str(answer.get("error")))
                continue
            if answer.get("skipped"):
                continue
            self.published += 1
            self.last_published_step = int(answer["global_step"])
            self.last_version = int(answer["version"])
            log_to_loggers(trainer, {"publish/version": float(self.last_version), "publish/seconds": float(answer["seconds"]),
                                     "publish/step": float(self.last_published_step)})
            get_timeline().fact(PUBLISH_FACT, version=self.last_version, step=self.last_published_step,
                                seconds=answer["seconds"], path=answer["path"])
            rank_zero_info(f"ModelPublisher: published {answer['path']} (step {self.last_published_step}, "
                           f"{answer['parameters']:,} parameters) in {answer['seconds']:.2f} s, off the training path")

    def _release(self, checkpoint: Path) -> None:
        _unpin(checkpoint)
        if self._checkpoint is not None:
            self._checkpoint.release(checkpoint)

    def _failed(self, trainer: pl.Trainer, step: int | None, error: str) -> None:
        self.errors.append(f"step {step}: {error}")
        log_to_loggers(trainer, {"publish/errors": float(len(self.errors))})
        get_timeline().fact(PUBLISH_ERROR_FACT, step=step, error=error)
        rank_zero_warn(f"ModelPublisher: publishing the checkpoint of step {step} failed; training goes on. {error}")

    # ------------------------------------------------------------------ end of fit, failures
    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Wait for the last publish (AsyncCheckpoint made the last checkpoint durable in its ``on_train_end``)."""
        if self._process is not None and self.wait_on_end:
            with record_phase(Phase.PUBLISH, trainer.global_step):
                deadline = time.monotonic() + self.end_timeout_s
                while (self._pending is not None or self._process.in_flight is not None) and time.monotonic() < deadline:
                    self._collect(trainer, self._process.wait_idle(max(deadline - time.monotonic(), 0.0)))
                    self._dispatch(trainer)
                if self._pending is not None or self._process.in_flight is not None:
                    self._failed(trainer, trainer.global_step, f"not published within end_timeout_s={self.end_timeout_s:g} s")
        if self.strict:
            errors = trainer.strategy.broadcast(list(self.errors), src=0)
            if errors:
                self._stop()
                raise ModelPublishError(f"ModelPublisher(strict=True): {len(errors)} publish(es) failed: " + "; ".join(errors))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._stop()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Stopped at once: after a preemption notice, the grace period belongs to AsyncCheckpoint's last save.
        self._stop(kill=True)

    def _stop(self, kill: bool = False) -> None:
        self._patches.undo()
        if self._checkpoint is not None:
            self._checkpoint.remove_listener(self)
        if self._pending is not None:
            self._release(Path(self._pending.source))
            self._pending = None
        if self._process is not None:
            in_flight = self._process.in_flight
            self._process.stop(timeout=0 if kill else 10.0)
            if in_flight is not None:
                self._release(Path(in_flight.source))
            self._process = None
        if self._owner is not None:  # the process is stopped: nothing more goes into dirpath
            self._owner.release()
            self._owner = None

    # ------------------------------------------------------------------ metrics
    def _metric_values(self, trainer: pl.Trainer, step: int) -> dict[str, float | None]:
        values: dict[str, float | None] = {}
        objects = self._metric_objects
        # A Metric nobody has updated yet has no value; the decision to compute must be the same on every rank.
        never_updated = any_rank(trainer, *(getattr(m, "_update_count", 0) == 0 for m in objects.values()),
                                 False)  # (one element at least: every rank reduces a non-empty tensor)
        for (name, metric), empty in zip(objects.items(), never_updated):
            if not empty:
                metric.compute()  # over all ranks; remembered by the wrapper
            values[name] = self._last_computed.get(name)
        if "loss" in self.metrics:
            loss = torch.full((), float("nan"), dtype=torch.float64, device=trainer.strategy.root_device)
            if self._last_loss is not None and self._last_loss[0] == step:
                loss = self._last_loss[1].to(device=loss.device, dtype=torch.float64).reshape(())
            local = float(loss)
            mean = float(trainer.strategy.reduce(loss, reduce_op="mean")) if trainer.world_size > 1 else local
            values["loss"] = None if math.isnan(mean) else mean
        if "epoch" in self.metrics:
            values["epoch"] = float(trainer.current_epoch)
        return values

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"published": self.published, "last_published_step": self.last_published_step, "last_version": self.last_version}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.published = int(state_dict.get("published", 0))
        self.last_published_step = int(state_dict.get("last_published_step", -1))
        self.last_version = state_dict.get("last_version")


def _resolve_metric(pl_module: pl.LightningModule, name: str) -> Any:
    """The ``torchmetrics.Metric`` at attribute path ``name`` (MetricCollection entries included)."""
    from torchmetrics import Metric, MetricCollection

    target: Any = pl_module
    for part in name.split("."):
        if isinstance(target, MetricCollection) and part in target.keys(keep_base=True):
            target = target[part]
        else:
            target = getattr(target, part, None)
    if isinstance(target, Metric):
        return target
    known = sorted(n for n, m in pl_module.named_modules() if isinstance(m, Metric) and n)
    raise ConfigurationError(
        f"ModelPublisher(metrics=[..., {name!r}, ...]): {name!r} is not a torchmetrics Metric of "
        f"{type(pl_module).__name__} (it has: {', '.join(known) or 'none'}) nor one of {', '.join(BUILTIN_METRICS)}. "
        "Values logged with self.log are known only once logged; name the Metric attribute instead."
        )


def _unpin(checkpoint: Path) -> None:
    try:
        (checkpoint / PIN_FILE).unlink(missing_ok=True)
    except OSError:
        pass  # the checkpoint is gone: nothing left to protect


__all__ = ["BUILTIN_METRICS", "ModelPublishError", "ModelPublisher"]
