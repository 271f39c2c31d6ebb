"""ETTMonitor: records where a Lightning job's wall time goes, and reports ETT%."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_ett.callbacks.loggers import log_breakdown, log_to_loggers, share_wandb_run
from lightning_ett.callbacks.startup import StartupProbe
from lightning_ett.durable.errors import explain
from lightning_ett.instrument.compile_events import compile_tracker
from lightning_ett.instrument.environment import (
    ENV_LAUNCHER,
    ENV_RUN_DIR,
    JobContext,
    import_time,
    resolve_job_context,
    write_job_file,
)
from lightning_ett.instrument.ledger import read_ledger
from lightning_ett.instrument.summary import Summary, summarize, summarize_run_dir
from lightning_ett.instrument.timeline import LOST, PHASE_NAMES, Phase, Timeline, get_timeline, record_phase
from lightning_ett.launch.faults import faults_from_env, maybe_fail_randomly, maybe_kill, random_failures_from_env
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
    """

    def __init__(self, run_dir: str | Path | None = None, log_every_n_steps: int = 50, report_on_end: bool = True) -> None:
        if not isinstance(log_every_n_steps, int) or isinstance(log_every_n_steps, bool) or log_every_n_steps < 1:
            raise ValueError(f"ETTMonitor(log_every_n_steps={log_every_n_steps!r}): expected an int >= 1, e.g. 50.")
        if run_dir is not None and not isinstance(run_dir, (str, Path)):
            raise TypeError(f"ETTMonitor(run_dir={run_dir!r}): expected a path (str or Path) or None.")
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
        self._faults = faults_from_env()  # the documented fault-injection switches (lightning_ett.launch.faults)
        self._random_failures = random_failures_from_env()
        self._mark = time.time()
        self._step_start: float | None = None
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

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_startup", None)  # waits for this process's Trainer; a copy elsewhere has none to time
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
        attempt = trainer.strategy.broadcast(self.context.attempt, src=0)
        if attempt != self.context.attempt:
            self.context = dataclasses.replace(self.context, attempt=attempt)
        ctx = self.context
        header = {"job_id": ctx.job_id, "job_start": ctx.job_start, "attempt_start": ctx.attempt_start,
                  "process_start": ctx.process_start, "world_size": trainer.world_size}
        self._timeline.bind(ctx.run_dir, trainer.global_rank, ctx.attempt, header)
        if trainer.is_global_zero:
            write_job_file(ctx.run_dir, ctx.job_id, ctx.job_start)
        self._mark = time.time()
        compile_tracker()  # compilations become `compile` events, nested in the step that triggered them
        self._wrap(trainer, "save_checkpoint", Phase.CHECKPOINT_SAVE)
        self._wrap(trainer.strategy, "load_checkpoint", Phase.CHECKPOINT_LOAD)

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

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_start = None  # a second fit starts with its own data_init
        if trainer.is_global_zero:
            self._prior = self._summarize_prior_attempts(trainer.global_step)
            if self._prior is not None:  # a restart re-runs steps: their ett/* rows are out already
                last = [a.last_step for a in self._prior.attempts if a.last_step is not None]
                self._logged_step = max([self._logged_step, *last])

    def _summarize_prior_attempts(self, resume_step: int) -> Summary | None:
        """Rank zero's view of earlier attempts, for the live ETT% (read once per attempt)."""
        ledgers = [lg for lg in read_ledger(self.run_dir, ranks={0}) if lg.attempt < self.context.attempt]
        if not any(lg.events for lg in ledgers):
            return None
        return summarize(ledgers, later_resume_step=resume_step)

    # ------------------------------------------------------------------ training
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:
            self._step_start = self._training_began = self._close(Phase.DATA_INIT, self._mark)
        self._batch_step = trainer.global_step

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self._step_start is not None
        self._step_start = self._close(Phase.TRAIN, self._step_start, self._batch_step)
        step = trainer.global_step
        if self._faults:
            maybe_kill(self._faults, trainer.global_rank, step, self.context.attempt)
        if self._random_failures is not None:
            maybe_fail_randomly(self._random_failures, trainer.global_rank, trainer.world_size, self.context.attempt,
                                time.time() - self._training_began)
        if trainer.is_global_zero and step % self.log_every_n_steps == 0 and step > self._logged_step and trainer.loggers:
            self._logged_step = step  # once per optimizer step, also under gradient accumulation
            log_to_loggers(trainer, self.live_metrics())

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
        job_start = self.context.job_start
        if self._prior is not None:
            job_start = min(job_start, self._prior.job_start)
            for phase, value in self._prior.phases.items():
                seconds[phase] += value
        for phase, value in self._timeline.exclusive_s.items():
            seconds[phase] += value
        return _metrics(seconds, wall=max(time.time() - job_start, 1e-9))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._patches.undo()
        if stage != "fit" or not trainer.is_global_zero:
            return
        summary = summarize_run_dir(self.run_dir, now=time.time())
        log_to_loggers(trainer, _metrics(summary.phases, summary.wall_s))
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
        else:
            rank_zero_warn(
                f"ETTMonitor: this checkpoint was written by ETT job {state_dict.get('job_id')!r} "
                f"(run_dir {state_dict.get('run_dir')!r}), not by this job ({self.context.job_id!r}). Its wall time "
                "and lost steps are not counted here; pass that run_dir to ETTMonitor (or set "
                "LIGHTNING_ETT_RUN_DIR) to count the restart as another attempt of the same job."
            )


def _metrics(seconds: dict[str, float], wall: float) -> dict[str, float]:
    """The logged names: ``ett/percent``, ``ett/<phase>_s`` and the headline seconds."""
    metrics = {f"ett/{phase}_s": value for phase, value in seconds.items() if value > 0}
    effective = seconds.get(Phase.TRAIN.value, 0.0)
    metrics.update({"ett/percent": 100.0 * effective / wall if wall > 0 else 0.0, "ett/wall_s": wall,
                    "ett/effective_s": effective, "ett/lost_s": seconds.get(LOST, 0.0)})
    return metrics
