"""ETTMonitor: records where a Lightning job's wall time goes, and reports ETT%."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ett.callbacks.loggers import health_metrics, log_breakdown, log_to_loggers, share_wandb_run
from lightning_ett.callbacks.startup import StartupProbe
from lightning_ett.callbacks.stragglers import StragglerProbe
from lightning_ett.compile.shapes import batch_size
from lightning_ett.durable.errors import ConfigurationError, ConfigurationTypeError, explain
from lightning_ett.instrument.compile_events import compile_tracker
from lightning_ett.instrument.environment import (
    ENV_HANG_WATCH,
    ENV_LAUNCHER,
    ENV_RUN_DIR,
    JobContext,
    env_rank,
    import_time,
    resolve_job_context,
    write_job_file,
)
from lightning_ett.instrument.ledger import read_ledger
from lightning_ett.instrument.step_health import RollingETT, StepHealth
from lightning_ett.instrument.summary import Summary, summarize, summarize_run_dir
from lightning_ett.instrument.timeline import BATCH_FACT, LOST, PHASE_NAMES, Phase, Timeline, get_timeline, record_phase
from lightning_ett.lifecycle.faults import (
    faults_from_env,
    hang_collective_group,
    hang_faults_from_env,
    maybe_fail_randomly,
    maybe_hang,
    maybe_kill,
    random_failures_from_env,
    slow_fault_from_env,
)
from lightning_ett.lifecycle.lifeline import hold_on_to_launcher
from lightning_ett.patching import Patches


class ETTMonitor(Callback):
    r"""Record the phases of a Lightning job and report its Effective Training Time.

    Phases come from Lightning's hooks and from the components that own the time, with no device
    synchronization (Lightning's ``ThroughputMonitor`` syncs CUDA every batch; this callback never
    touches the device):

    * ``import``: process start → ``lightning_ett`` imported.
    * ``trainer_init``, ``lightning_launcher``, ``process_group_init``, ``logger_init``: the Trainer's
      construction, Lightning's launcher, ``strategy.setup_environment`` and the loggers' start-up
      (:mod:`lightning_ett.callbacks.startup`, which also starts the loggers in the background).
    * ``data_init``: ``prepare_data`` and ``LightningDataModule.setup``; then ``on_fit_start`` → first
      batch (loop restore, data-loader start-up, first fetch).
    * ``model_init``: ``setup`` → ``on_fit_start`` (``setup`` hooks, ``configure_model``, strategy setup).
    * ``compile``: every ``torch.compile`` compilation in the process, whoever asked for it
      (Dynamo's compile callbacks), so a first step that compiles is not counted as training.
    * ``train``: each training-step interval, data fetch included; ``eval`` (validation,
      sanity check, test) and ``checkpoint_save`` / ``checkpoint_load`` (timed around
      ``trainer.save_checkpoint`` and ``strategy.load_checkpoint``) nested inside it are not.
    * ``shutdown``: end of training → process exit.
    * ``other``: time no component claimed (the user's code between ``Trainer()`` and ``fit``).
    * ``hang`` (under ``lightning run``): a hung attempt, from each rank's last progress to the kill.

    Under ``lightning run`` the monitor also writes a ``begin`` record when a phase starts and
    dumps its stacks on SIGUSR2, for the launcher's hang watch (:mod:`lightning_ett.launch.hang_response`).

    Every attempt of the job writes into one W&B run (the job's id, resumed), and ``ett/*`` is
    logged only at steps past those earlier attempts logged, so its charts never step back.

    Other components add phases with :func:`lightning_ett.record_phase`.

    Args:
        run_dir: the job's run directory (ledger, ``ett_summary.json``, PNG). Defaults to
            ``$LIGHTNING_ETT_RUN_DIR`` or ``./ett_runs/<job id>``. Restarts that pass the same
            directory are attempts of one job.
        log_every_n_steps: how often (training steps) rank zero logs ``ett/percent`` and
            ``ett/<phase>_s`` to every attached logger; the final values are logged at the end.
        report_on_end: print the rich table at the end of ``fit`` (under ``lightning run`` the launcher prints it
            for the whole job instead).
        straggler_every_n_steps: every N training batches the ranks all-gather their per-batch timestamps (one
            tiny collective) to find the rank the others wait for (:mod:`lightning_ett.watch.stragglers`);
            0, or a single rank, disables it.
        straggler_threshold: a rank is named a straggler when the others wait for it more than this fraction of
            the ideal step time per step (never under 2 ms); the monitor warns after 2 windows in a row.

    Rank zero also logs step-time health with the ``ett/*`` figures: ``ett/ideal_step_s`` (median of recent
    steps with no checkpoint write, evaluation or compile in them), ``ett/step_time_deviation`` (their recent
    p90 minus it), ``ett/interval_percent_{5m,15m,60m}`` (ETT% over the last W minutes) and, with several
    ranks, ``ett/straggler_rank`` (-1: none) and ``ett/straggler_score_s``.
    """

    def __init__(self, run_dir: str | Path | None = None, log_every_n_steps: int = 50, report_on_end: bool = True,
                 straggler_every_n_steps: int = 25, straggler_threshold: float = 0.1) -> None:
        _check_straggler_args(straggler_every_n_steps, straggler_threshold)
        if not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 1:
            raise ConfigurationError(f"ETTMonitor(log_every_n_steps={log_every_n_steps!r}): expected an int >= 1, e.g. 50.")
        if run_dir is not None and not isinstance(run_dir, (str, Path)):
            raise ConfigurationTypeError(f"ETTMonitor(run_dir={run_dir!r}): expected a path (str or Path) or None.")
        self.log_every_n_steps = log_every_n_steps
        self.report_on_end = report_on_end
        # Resolved now, not at setup: Lightning spawns the other ranks before `setup`, and
        # they must inherit this job's id, start and attempt through the environment.
        launched_into = os.environ.get(ENV_RUN_DIR) if ENV_LAUNCHER in os.environ else None
        if launched_into and run_dir is not None and Path(run_dir).expanduser().absolute() != Path(launched_into):
            rank_zero_warn(
                f"ETTMonitor(run_dir={str(run_dir)!r}) differs from the run directory `lightning run` gave this job "
                f"({launched_into!r}): the job's report will not see this ledger. Leave `run_dir` unset under `lightning run`."
            )
        self.context: JobContext = resolve_job_context(run_dir)
        hold_on_to_launcher()  # `--no-preload` workers die with `lightning run` too (no-op elsewhere)
        self._faults = faults_from_env()  # the documented fault-injection switches (lightning_ett.lifecycle.faults)
        self._random_failures = random_failures_from_env()
        self._hang_faults = hang_faults_from_env()
        self._hang_group: Any = None  # the side group an injected collective hang blocks on
        self._stragglers = StragglerProbe(straggler_every_n_steps, straggler_threshold, slow_fault_from_env())
        self._health = StepHealth()  # this rank's steps; rank zero's are logged
        self._rolling: RollingETT | None = None  # rank zero: ETT% over the last 5/15/60 minutes
        self._step_records = 0  # Timeline.recorded when the current step began
        self._last_step: tuple[float, int] | None = None  # (duration, records at its start): judged at the next start
        self._bound_early = False
        self._stage: str | None = None  # Lightning's stage of the current run (setup): only "fit" resumes a job
        if os.environ.get(ENV_HANG_WATCH):  # `lightning run` watches this rank's ledger for hangs
            from lightning_ett.watch.stacks import register_dump_signal, stack_dump_path

            # Done already in lightning run's workers; here for a process they did not start.
            register_dump_signal(stack_dump_path(self.context.run_dir, self.context.attempt, env_rank()))
            self._timeline.announce = True
            # The launcher numbered the attempt and torchelastic the rank: bind now, so that the watch sees this
            # rank from here on (the data module's setup runs before any callback hook) and what it begins.
            self._timeline.bind(self.context.run_dir, env_rank(), self.context.attempt, self._header(world_size=None))
            self._bound_early = True
        self._mark = time.time()
        self._step_start: float | None = None
        self._began_at = 0  # the global step this fit began or resumed at
        self._training_began = time.time()  # this attempt's first training batch (set then)
        self._batch_step: int | None = None
        self._eval_start: float | None = None
        self._prior: Summary | None = None
        self._logged_step = -1  # ett/* rows go out only past this step (earlier attempts' rows included)
        self._patches = Patches()
        self._startup = StartupProbe(self, self._patches, self._name_wandb_run)
        if not self._timeline.import_recorded:
            imported = import_time()
            self._timeline.record(Phase.IMPORT, min(self.context.process_start, imported), imported)
            self._timeline.import_recorded = True

    def _header(self, world_size: int | None, device: str | None = None) -> dict[str, Any]:
        ctx = self.context
        return {"job_id": ctx.job_id, "job_start": ctx.job_start, "attempt_start": ctx.attempt_start,
                "process_start": ctx.process_start, "world_size": world_size, "device": device}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_startup", None)  # waits for this process's Trainer; a copy elsewhere has none to time
        state["_hang_group"] = None  # a process group does not travel
        return state

    def _name_wandb_run(self, loggers: list[Any]) -> None:
        share_wandb_run(loggers, self.context.job_id, self.context.job_start)

    @property
    def _timeline(self) -> Timeline:
        # Looked up, not stored: the callback must stay picklable (ddp_spawn, LightningCLI).
        return get_timeline()

    @property
    def run_dir(self) -> Path:
        return self.context.run_dir

    # ------------------------------------------------------------------ start-up
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Ranks that count their own ledger files (no launcher numbered the attempt) could disagree
        # if a rank died before writing one: take rank 0's number (one tiny broadcast, once).
        self._stage = stage
        attempt = trainer.strategy.broadcast(self.context.attempt, src=0)
        if attempt != self.context.attempt:
            self.context = dataclasses.replace(self.context, attempt=attempt)
        ctx = self.context
        header = self._header(trainer.world_size, trainer.strategy.root_device.type)
        self._timeline.bind(ctx.run_dir, trainer.global_rank, ctx.attempt, header)
        if self._bound_early:  # its header was written then: add what only the Trainer knows
            self._timeline.amend_header(world_size=trainer.world_size, device=header["device"])
        if trainer.is_global_zero:
            write_job_file(ctx.run_dir, ctx.job_id, ctx.job_start)
        self._mark = time.time()
        self._timeline.begin(Phase.MODEL_INIT)
        if self._hang_faults.in_collective:
            self._hang_group = hang_collective_group()  # a collective: every rank makes it
        compile_tracker()  # compilations become `compile` events, nested in the step that triggered them
        if self.context.attempt > 0:  # a restart of this job: LightningCLI's config file is its own first attempt's
            for callback in trainer.callbacks:
                if type(callback).__name__ == "SaveConfigCallback" and not getattr(callback, "overwrite", True):
                    self._patches.setattr(callback, "overwrite", True)
        self._wrap(trainer, "save_checkpoint", Phase.CHECKPOINT_SAVE)
        self._wrap(trainer.strategy, "load_checkpoint", Phase.CHECKPOINT_LOAD)
        connector = trainer._checkpoint_connector
        if all(hasattr(connector, a) for a in ("_restore_modules_and_callbacks", "restore_training_state",
                                               "_loaded_checkpoint")):
            for name in ("_restore_modules_and_callbacks", "restore_training_state"):  # the second: optimizers, loops
                self._patches.setattr(connector, name, _timed_restore(connector, name))
        self._stragglers.setup(trainer, pl_module, self._patches)

    def _wrap(self, owner: Any, name: str, phase: Phase) -> None:
        """Time a method Lightning calls but announces with no 'after' hook."""
        original = getattr(owner, name)
        if getattr(original, "_ett_wrapped", False):
            return
        timed = record_phase(phase)(original)
        timed._ett_wrapped = True  # type: ignore[attr-defined]
        self._patches.setattr(owner, name, timed)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._mark = self._close(Phase.MODEL_INIT, self._mark)
        self._timeline.begin(Phase.DATA_INIT)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timeline.begin(Phase.DATA_INIT)  # the epoch's data loader starts (workers spawn) before its first batch

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # For the hang watch: epoch-end hooks (the module's run after this) and the next epoch's loader
        # start are an epoch boundary, with its generous timeout, until the next step begins.
        self._timeline.begin(Phase.DATA_INIT)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_start = None  # a second fit starts with its own data_init
        self._began_at = trainer.global_step  # (a fault at a step this fit resumed past never fires)
        if trainer.is_global_zero:
            self._prior = self._summarize_prior_attempts(trainer.global_step)
            if self._prior is not None:  # a restart re-runs steps: their ett/* rows are out already
                last = [a.last_step for a in self._prior.attempts if a.last_step is not None]
                self._logged_step = max([self._logged_step, *last])
            if self._rolling is None:  # kept across fits of one process, as the timeline's totals are
                self._rolling = RollingETT(self._job_start())
                self._rolling.seed(self._prior.segments.get(0, []) if self._prior is not None else [])
        self._stragglers.on_train_start(trainer, pl_module)
        self._last_step = None

    def _summarize_prior_attempts(self, resume_step: int) -> Summary | None:
        """Rank zero's view of earlier attempts, for the live ETT% (read once per attempt)."""
        ledgers = [lg for lg in read_ledger(self.run_dir, ranks={0}) if lg.attempt < self.context.attempt]
        if not any(lg.events for lg in ledgers):
            return None
        return summarize(ledgers, later_resume_step=resume_step)

    # ------------------------------------------------------------------ training
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._stragglers.on_batch_start(trainer, self._health)  # stamps `ready` first
        if self._step_start is None:
            self._step_start = self._training_began = self._close(Phase.DATA_INIT, self._mark)
            self._timeline.fact(BATCH_FACT, samples=batch_size(batch), step=trainer.global_step)  # throughput's unit
        if self._last_step is not None:  # clean: nothing but its own event was recorded since it began
            seconds, records = self._last_step
            self._health.add(seconds, clean=self._timeline.recorded - records == 1)
            self._last_step = None
        self._step_records = self._timeline.recorded
        self._batch_step = trainer.global_step
        self._timeline.begin(Phase.TRAIN, self._batch_step)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self._step_start is not None
        began, self._step_start = self._step_start, self._close(Phase.TRAIN, self._step_start, self._batch_step)
        # Judged at the next batch's start: a component may still record into this step (AsyncCheckpoint's carve).
        self._last_step = (self._step_start - began, self._step_records)
        if self._rolling is not None:
            self._rolling.observe(self._step_start, self._train_s())
        step = trainer.global_step
        if self._faults:
            maybe_kill(self._faults, trainer.global_rank, step, self.context.attempt, self._began_at)
        if self._hang_faults:
            maybe_hang(self._hang_faults, trainer.global_rank, step, self.context.attempt, self._hang_group,
                       self._began_at)
        if self._random_failures is not None:
            maybe_fail_randomly(self._random_failures, trainer.global_rank, trainer.world_size, self.context.attempt,
                                time.time() - self._training_began)
        if trainer.is_global_zero and step % self.log_every_n_steps == 0 and step > self._logged_step and trainer.loggers:
            self._logged_step = step  # once per optimizer step, also under gradient accumulation
            log_to_loggers(trainer, self.live_metrics())

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Any) -> None:
        self._stragglers.on_before_backward()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timeline.shutdown_from = time.time()  # recorded as `shutdown` when the process exits

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._timeline.set_status("finished")

    # ------------------------------------------------------------------ evaluation
    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_start = time.time()
        self._timeline.begin(Phase.EVAL)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close_eval()

    on_test_start = on_validation_start  # same signature, same job: testing is `eval` too
    on_test_end = on_validation_end

    def _close_eval(self) -> None:
        if self._eval_start is not None:
            self._close(Phase.EVAL, self._eval_start)
            self._eval_start = None

    def _close(self, phase: Phase, start: float, step: int | None = None) -> float:
        end = time.time()
        self._timeline.record(phase, start, end, step)
        return end

    # ------------------------------------------------------------------ reporting
    def live_metrics(self) -> dict[str, float]:
        """Rank zero's running ETT: earlier attempts (from the ledger) plus this attempt."""
        seconds = dict.fromkeys(PHASE_NAMES, 0.0)
        job_start = self._job_start()
        if self._prior is not None:
            for phase, value in self._prior.phases.items():
                seconds[phase] += value
        for phase, value in self._timeline.exclusive_s.items():
            seconds[phase] += value
        now = time.time()
        metrics = _metrics(seconds, wall=max(now - job_start, 1e-9))
        metrics.update(self._health.metrics())
        if self._rolling is not None:
            metrics.update(self._rolling.metrics(now, seconds[Phase.TRAIN.value]))
        metrics.update(self._stragglers.metrics())
        return metrics

    def _job_start(self) -> float:
        return self.context.job_start if self._prior is None else min(self.context.job_start, self._prior.job_start)

    def _train_s(self) -> float:
        """Train seconds of the job so far on this rank: earlier attempts (rank zero's ledger) and this process."""
        prior = self._prior.phases.get(Phase.TRAIN.value, 0.0) if self._prior is not None else 0.0
        return prior + self._timeline.exclusive_s.get(Phase.TRAIN.value, 0.0)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._patches.undo()
        if stage != "fit" or not trainer.is_global_zero:
            return
        summary = summarize_run_dir(self.run_dir, now=time.time())
        log_to_loggers(trainer, {**_metrics(summary.phases, summary.wall_s), **health_metrics(summary)})
        from lightning_ett.instrument.report import REPORT_PNG, write_report

        wandb_loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if ENV_LAUNCHER in os.environ and not wandb_loggers:
            summary.write_json(self.run_dir)  # the launcher writes the job's report (PNG, table) once the job ends
        else:  # W&B shows the PNG; without a launcher, this is the report
            write_report(summary, self.run_dir, show=self.report_on_end and ENV_LAUNCHER not in os.environ)
        for logger in wandb_loggers:
            log_breakdown(logger.experiment, summary, self.run_dir / REPORT_PNG)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._patches.undo()
        if isinstance(exception, SIGTERMException):  # asked to stop (a scheduler, Ctrl-C under `lightning run`):
            self._timeline.set_status("stopped", reason="SIGTERM")  # every rank stopped after the same batch
        else:
            self._timeline.set_status("failed", reason=explain(exception))
        self._timeline.shutdown_from = time.time()

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"job_id": self.context.job_id, "job_start": self.context.job_start, "run_dir": str(self.run_dir)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        same_run_dir = state_dict.get("run_dir") == str(self.run_dir)
        if state_dict.get("job_id") == self.context.job_id or same_run_dir:
            job_start = min(float(state_dict["job_start"]), self.context.job_start)
            self._timeline.amend_header(job_start=job_start)
            self.context = dataclasses.replace(self.context, job_start=job_start)
        elif self._stage in (None, "fit"):  # (validate/test/predict on another job's checkpoint restart nothing)
            begins = (f"ETTMonitor: this fit begins from a checkpoint of ETT job {state_dict.get('job_id')!r} (run_dir "
                      f"{state_dict.get('run_dir')!r}); this job ({self.context.job_id!r}) counts its ETT% from its own "
                      "start, as a new job begun from it (a fine-tune, the next stage)")
            if ENV_LAUNCHER in os.environ:  # (lightning run restarts a job in its own run dir itself)
                rank_zero_info(begins + ". If this is a relaunch of that job, start `lightning run` with its --run-dir "
                               f"({state_dict.get('run_dir')!r}) to count it as another attempt of the same job.")
            else:
                rank_zero_warn(begins + ". If this is a restart of that job, pass its run_dir to ETTMonitor (or set "
                               "LIGHTNING_ETT_RUN_DIR) to count it as another attempt of the same job.")


def _timed_restore(connector: Any, name: str) -> Any:
    """Lightning's restore from a checkpoint as ``checkpoint_load``: ``_restore_modules_and_callbacks`` (the load,
    then the model's, data module's and callbacks' state, their ``on_load_checkpoint`` hooks included) and
    ``restore_training_state`` (optimizers, loops). A restore with no checkpoint records nothing.

    Whether there is one is known only after the load (AsyncCheckpoint picks it inside ``resume_start``), so the
    first is announced when the model's state is restored, and each is recorded from its start to its end.
    """
    restore = getattr(connector, name)

    @functools.wraps(restore)
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        patches = Patches()
        if connector._loaded_checkpoint:
            get_timeline().begin(Phase.CHECKPOINT_LOAD)
        else:
            restore_model = connector.restore_model

            def announced_restore_model() -> Any:
                if connector._loaded_checkpoint:
                    get_timeline().begin(Phase.CHECKPOINT_LOAD)
                return restore_model()

            patches.setattr(connector, "restore_model", announced_restore_model)
        try:
            return restore(*args, **kwargs)
        finally:
            patches.undo()
            if connector._loaded_checkpoint:
                get_timeline().record(Phase.CHECKPOINT_LOAD, start, time.time())

    return timed


def _check_straggler_args(every_n_steps: Any, threshold: Any) -> None:
    if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 0:
        raise ConfigurationError(f"ETTMonitor(straggler_every_n_steps={every_n_steps!r}): expected an int >= 0, e.g. 25 "
                                 "(0 disables the straggler diagnosis).")
    if (not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not threshold > 0
            or threshold == float("inf")):
        raise ConfigurationError(f"ETTMonitor(straggler_threshold={threshold!r}): expected a number > 0, the fraction of the "
                                 "ideal step time the others must wait for one rank per step to name it, e.g. 0.1 (10%).")


def _metrics(seconds: dict[str, float], wall: float) -> dict[str, float]:
    """The logged names: ``ett/percent``, ``ett/<phase>_s`` and the headline seconds."""
    metrics = {f"ett/{phase}_s": value for phase, value in seconds.items() if value > 0}
    effective = seconds.get(Phase.TRAIN.value, 0.0)
    metrics.update({"ett/percent": 100.0 * effective / wall if wall > 0 else 0.0, "ett/wall_s": wall,
                    "ett/effective_s": effective, "ett/lost_s": seconds.get(LOST, 0.0)})
    return metrics
