"""AsyncCheckpoint: non-blocking, durable checkpoints with automatic resume."""

from __future__ import annotations

import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Literal, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lightning_ett.callbacks.collectives import any_rank, raise_on_every_rank
from lightning_ett.callbacks.directory_owner import own_directory
from lightning_ett.callbacks.loggers import log_to_loggers
from lightning_ett.callbacks.loop_state import accumulating
from lightning_ett.checkpoint import layout as fmt
from lightning_ett.checkpoint.cadence import FIRST_SAVE_STEPS, CadenceDecision, CadenceTracker, estimate_mtbf_s
from lightning_ett.checkpoint.chain import DELTA_OPEN_BYTES_PER_RANK, MAX_EXTRA_RESTORE, Rebase, next_delta_budget
from lightning_ett.checkpoint.save_kind import SaveKindChooser
from lightning_ett.checkpoint.staging import Snapshot, Stager, storages
from lightning_ett.checkpoint.writer import (
    CheckpointWriteError,
    CheckpointWriter,
    CommittedUnconfirmedError,
    WriteResult,
)
from lightning_ett.durable.commit import remove_stale
from lightning_ett.durable.errors import (
    ANOTHER_RANKS_ERROR,
    CHOSEN_CHECKPOINT_ATTR,
    ConfigurationError,
    ConfigurationTypeError,
    check_full_every,
    explain,
)
from lightning_ett.durable.files import writable_dir_error
from lightning_ett.durable.ownership import CHECKPOINT_OWNER_FILE, OwnerLock
from lightning_ett.durable.procfs import process_start_ticks
from lightning_ett.instrument.cadence_facts import cadence_line, mtbf_is_assumed
from lightning_ett.instrument.environment import (
    ENV_ATTEMPT,
    ENV_JOB_START,
    ENV_RUN_DIR,
    launched_job,
)
from lightning_ett.instrument.ledger import failed_attempts
from lightning_ett.instrument.timeline import CADENCE_FACT, CHECKPOINT_FACT, Phase, get_timeline, record_phase
from lightning_ett.patching import Patches

WhenBusy = Literal["skip", "wait"]
_TIME_CHECK_EVERY = 16  # multi-rank `every_n_minutes`: rank 0's clock is consulted every this many steps


class CheckpointListener(Protocol):
    """What another callback (ModelPublisher) hears from AsyncCheckpoint; register with :meth:`AsyncCheckpoint.add_listener`."""

    def on_checkpoint_snapshot(self, trainer: pl.Trainer, step: int) -> None:
        """Every rank, right after the snapshot of ``step`` (a step boundary: collectives are safe here)."""

    def on_checkpoint_durable(self, trainer: pl.Trainer, path: Path, step: int) -> None:
        """Global rank 0, on the training thread, once the checkpoint of ``step`` is committed at ``path``."""


def _as_begun_from(ckpt_path: Any) -> str:
    """``fit``'s ``ckpt_path`` as a manifest's ``began`` records it: a local path made absolute and normalised, so
    ``a/b``, ``a/b/`` and ``./a//b`` are one checkpoint to begin from (symlinks are kept: a link moved to another
    target is another checkpoint); a URL without its trailing slash."""
    text = str(ckpt_path)
    if "://" in text:
        return text.rstrip("/")
    return os.path.abspath(os.path.normpath(os.path.expanduser(text)))


def _inside(path: Any, directory: Path) -> bool:
    """Whether a local ``path`` lies in ``directory`` (one of its checkpoints)."""
    text = str(path)
    return "://" not in text and Path(os.path.realpath(text)).parent == Path(os.path.realpath(directory))


def _this_process() -> str:
    """This process, as a manifest names the writer of a checkpoint: the host's boot, the pid and its start in clock
    ticks since boot (no wall clock: a clock step cannot change it), read when called (a worker forked from the
    preloaded server shares every value computed at import)."""
    pid = os.getpid()
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{boot}:{pid}@{process_start_ticks(pid)}"


#: Without ``verbose``, the "durable at" lines after a fit's first come at most this often (and at its last save).
QUIET_LINE_EVERY_S = 600.0

_committed_here: set[str] = set()  # rank 0: the dirpaths this process committed checkpoints to (earlier fits included)


class AsyncCheckpoint(Checkpoint):
    r"""Checkpoint without stopping training: snapshot at a step boundary, write in the background.

    At a due step's boundary (after the optimizer step) the whole Lightning checkpoint —
    model, dense and fused optimizers, loops, callbacks, datamodule — is snapshotted into CPU
    buffers reused across saves (pinned on CUDA; no second copy on the accelerator). Only the
    small part is copied at the boundary: everything but the parameters and the optimizers'
    states, which are copied by the writer thread while the next step fetches its batch and
    runs its forward pass. The training thread waits for that copy only right before the
    first thing that could change them: the backward pass when TorchRec's fused optimizer
    updates tables in it, else the optimizer step (on CUDA it does not wait at all: the copies
    run on a side stream and the compute stream waits for their event). The snapshot is the
    state at the due step, bit for bit; one changed earlier (an in-place update in forward) is
    detected by its version counter, never written, and the save is taken again at the next
    step boundary with that tensor copied at once (see :mod:`lightning_ett.checkpoint.staging`).
    The writer thread then writes it with
    ``torch.distributed.checkpoint`` while training continues, and commits it atomically:
    fsync, ``manifest.json`` with CRC-32s, rename, ``latest``, retention. See
    :mod:`lightning_ett.checkpoint.layout` for the layout and :mod:`lightning_ett.durable.commit` for the commit.

    Under ``ETTStrategy`` every rank writes its own shards (collectively, on a dedicated gloo
    group); with other strategies the global rank 0 writes the whole checkpoint.

    Args:
        dirpath: directory of the checkpoints (one sub-directory ``step-<global step>`` each).
        every_n_train_steps: save every N optimizer steps, or ``"auto"``: at the interval that
            minimizes expected overhead, Young/Daly's ``sqrt(2 · save cost · MTBF)``. The save
            cost is measured (training blocked + training slowed while the write runs; the
            first save, after 20 steps, measures it) and re-measured at every save; the
            interval is re-evaluated each time, logged with the predicted overhead, and stated
            in the ETT report ("expected loss per failure at this cadence"). ``when_busy`` does
            not apply: saves are at least 1.25 write durations apart (before the first write is
            measured, a save due while one is in flight is postponed a step).
        every_n_minutes: save when this many minutes have passed since the last save (rank 0's
            clock decides; with several ranks it is consulted every 16 steps). Give exactly
            one of ``every_n_train_steps`` / ``every_n_minutes``.
        keep_last_n: complete checkpoints to keep (``None``: all). The newest complete one is
            never deleted, and old ones only after a newer one is committed.
        save_on_train_end: also save when ``fit`` ends (and wait until it is durable).
        when_busy: a save that comes due while the previous one is still being written is
            ``"skip"``\ped (with a warning; training never blocks on a slow disk) or waits
            for it (``"wait"``; the wait counts as ``checkpoint_save``).
        resume: with no ``ckpt_path`` given to ``fit``, resume from the newest *complete*
            checkpoint in ``dirpath`` (damaged ones are skipped with a warning naming them).
            An explicit ``ckpt_path`` wins where a fit begins; a later start of the job under
            ``lightning run`` (a restart, a relaunch) resumes from what the job committed in a fit
            begun from that same ``ckpt_path``, if anything.
        verify_checksums: on resume, check every file's CRC-32 (else only its size).
        overlap_staging: copy parameters and optimizer states in the background while the
            next step's forward runs (default). ``False`` copies everything at the boundary:
            for a model that changes its parameters in forward through ``.data`` or a raw
            kernel, which no version counter sees.
        mtbf_hours: ``"auto"`` only: the job's mean time between failures. ``None``: the
            job's wall time divided by the failures its ledger recorded (previous attempts
            that did not finish; under ``lightning run`` or with ETTMonitor); before the first
            failure, a third of the job's age (no failure in ``W`` seconds rules out rates
            above ``3/W`` at 95 %), so a young job saves often and an old one rarely.
        max_interval_minutes: ``"auto"`` only: save at least this often, however rare failures
            are. (The shortest interval is automatic: 1.25 write durations, so saves never pile up.)
        incremental: between full saves, write only the rows of the sharded tables (and of
            their fused optimizer states: row-wise AdaGrad's sums, Adam's moments) that changed
            since the previous save, plus the whole dense state (ETTStrategy only; other
            strategies hold no sharded tables, and every save stays full). Changed rows are
            found by comparing with the previous save's copy, byte for byte, so resuming from a
            full save plus its deltas is exactly resuming from a full save of that step, on any
            world size or sharding. Costs a second set of staging buffers for the sharded tables
            (host RAM) and one comparison pass in the writer thread. Chain policy, consecutive
            deltas (each against the previous save): they write the fewest bytes (a row changed
            in every interval is written once per save, as a one-shot differential against the
            last full save would too, but a row changed once is written once, where the
            differential writes it again at every later save), at the price of reading the
            chain on restore. A chain is kept to what restores in an estimated 1.4 full restores
            (0.1 under the 1.5 the design aims at: measured restores exceeded the estimate by up
            to 0.12), from the committed bytes of the full save and the deltas and a fixed cost
            per delta (its files opened and parsed: many tiny deltas restore slowly too, and on
            small tables a full save is cheap anyway; see ``chain.next_delta_budget``). When the
            next delta would not fit, the save is a *rebase* where it pays: every row changed
            since the chain's full save, built on that full save alone, so a restore reads the
            full save, the rebase and the deltas after it (on a heavy-tailed stream the rows
            changed since a full save grow far slower than the deltas' sum: a rebase is a
            fraction of a full save); once a full save costs less per save than the next
            rebase, the save is full (``chain.Rebase``). A save is also full while deltas cost about as much
            as full saves, by their measured true cost (blocked + slowdown): a delta must cost
            under 80 % of a full save; after two in a row that do not, the next 2 saves are full, then a delta is tried
            again (after 4, 8, up to 16 while deltas keep losing; ``save_kind``): on ids spread
            uniformly over the tables most rows change between saves, and a delta costs more
            than a full save. Peak host
            memory while a delta is written: the changed rows gathered, at most about the size of
            the tables (a shard whose changed rows with their numbers would outweigh it is written
            whole, not gathered). ``False``
            (default) until the benchmark settles it (see
            ``benchmarks/README.md``).
        full_every_n_saves: with ``incremental``: every N-th save is full, whatever the chain's
            size or the costs (``None``: by the estimated restore time and the measured costs, as above).
        verbose: a console line at every save that becomes durable. ``False`` (default): the first and
            the last of a fit, and otherwise at most one every :data:`QUIET_LINE_EVERY_S` seconds, counting
            the saves since (``"auto"`` saves a young job every few steps; every save is still logged to
            the loggers as ``checkpoint/*``).

    ETT: only the blocking part of a save is reported as ``checkpoint_save``; the background
    write is logged to every logger as ``checkpoint/write_s`` (with ``checkpoint/blocked_s``,
    ``checkpoint/staging_bytes`` and ``checkpoint/overlapped_bytes``, the part copied while the
    next step ran); the load on resume is ``checkpoint_load``.

    A failure of the background writer (disk full, permissions, I/O error) is raised on the
    training thread at the next save or at the end of ``fit`` as ``CheckpointWriteError``.
    """

    def __init__(
        self,
        dirpath: str | Path,
        every_n_train_steps: int | Literal["auto"] | None = None,
        every_n_minutes: float | None = None,
        keep_last_n: int | None = 3,
        save_on_train_end: bool = True,
        when_busy: WhenBusy = "skip",
        resume: bool = True,
        verify_checksums: bool = True,
        mtbf_hours: float | None = None,
        max_interval_minutes: float = 60.0,
        overlap_staging: bool = True,
        incremental: bool = False,
        full_every_n_saves: int | None = None,
        verbose: bool = False,
    ) -> None:
        if not isinstance(dirpath, (str, Path)) or not str(dirpath):
            raise ConfigurationTypeError(f"AsyncCheckpoint(dirpath={dirpath!r}): expected a directory path (str or Path).")
        if every_n_train_steps is None and every_n_minutes is None:
            raise ConfigurationError("AsyncCheckpoint: give `every_n_train_steps` (e.g. 1000) or `every_n_minutes` (e.g. 30).")
        if every_n_train_steps is not None and every_n_minutes is not None:
            raise ConfigurationError(
                f"AsyncCheckpoint(every_n_train_steps={every_n_train_steps!r}, every_n_minutes={every_n_minutes!r}): "
                "the two intervals conflict; give only one."
                )
        auto = every_n_train_steps == "auto"
        if every_n_train_steps is not None and not auto and (
            not isinstance(every_n_train_steps, int) or isinstance(every_n_train_steps, bool) or every_n_train_steps < 1
        ):
            raise ConfigurationError(
                f"AsyncCheckpoint(every_n_train_steps={every_n_train_steps!r}): expected an int >= 1 or 'auto'.")
        if mtbf_hours is not None and (isinstance(mtbf_hours, bool) or not isinstance(mtbf_hours, (int, float))
                                       or mtbf_hours <= 0):
            raise ConfigurationError(f"AsyncCheckpoint(mtbf_hours={mtbf_hours!r}): expected a number of hours > 0, or None to "
                                     "estimate it from the job's ledger.")
        if isinstance(max_interval_minutes, bool) or not isinstance(max_interval_minutes, (int, float)) \
                or not max_interval_minutes > 0:
            raise ConfigurationError(f"AsyncCheckpoint(max_interval_minutes={max_interval_minutes!r}): expected a number > 0.")
        if not auto and (mtbf_hours is not None or max_interval_minutes != 60.0):
            rank_zero_warn("AsyncCheckpoint: `mtbf_hours` and `max_interval_minutes` only apply to "
                           "every_n_train_steps='auto'; they are ignored.")
        if every_n_minutes is not None and (isinstance(every_n_minutes, bool) or not isinstance(every_n_minutes, (int, float))
                                            or every_n_minutes <= 0):
            raise ConfigurationError(f"AsyncCheckpoint(every_n_minutes={every_n_minutes!r}): expected a number > 0.")
        if keep_last_n is not None and (not isinstance(keep_last_n, int) or isinstance(keep_last_n, bool) or keep_last_n < 1):
            raise ConfigurationError(f"AsyncCheckpoint(keep_last_n={keep_last_n!r}): expected an int >= 1, or None to keep all.")
        if when_busy not in ("skip", "wait"):
            raise ConfigurationError(f"AsyncCheckpoint(when_busy={when_busy!r}): expected 'skip' or 'wait'.")
        if not isinstance(overlap_staging, bool):
            raise ConfigurationTypeError(f"AsyncCheckpoint(overlap_staging={overlap_staging!r}): expected True or False.")
        if not isinstance(incremental, bool):
            raise ConfigurationTypeError(f"AsyncCheckpoint(incremental={incremental!r}): expected True or False.")
        if not isinstance(verbose, bool):
            raise ConfigurationTypeError(f"AsyncCheckpoint(verbose={verbose!r}): expected True or False.")
        check_full_every("AsyncCheckpoint", "full_every_n_saves", full_every_n_saves, "incremental", incremental, "save")
        self.dirpath = Path(dirpath)
        self.every_n_train_steps = every_n_train_steps
        self.auto = auto
        self.mtbf_hours = mtbf_hours
        self.max_interval_minutes = float(max_interval_minutes)
        self.every_n_minutes = every_n_minutes
        self.keep_last_n = keep_last_n
        self.save_on_train_end = save_on_train_end
        self.when_busy: WhenBusy = when_busy
        self.resume = resume
        self._manifest_fields: dict[str, Any] = {}  # what this fit's checkpoints say it began from (`began`)
        self.verify_checksums = verify_checksums
        self.overlap_staging = overlap_staging
        self.incremental = incremental
        self.full_every_n_saves = full_every_n_saves
        self.verbose = verbose
        self._durable_said_at: float | None = None  # rank 0: the last "durable at" line this fit (monotonic)
        self._durable_unsaid = 0  # and the saves durable since, not said
        self._newest_durable: tuple[int, Path] | None = None  # rank 0: (step, path) of the newest durable save
        # rank 0: the chain a restore of the last save reads, from committed results (a restart starts with a full save)
        self._full_bytes = 0
        self._chain_bytes = 0
        self._last_delta_bytes = 0
        self._since_full_bytes = 0  # what a rebase would have held at the last delta
        self._said_no_delta = False
        self._deltas_in_chain = 0
        self._kinds = SaveKindChooser()  # rank 0: what deltas and full saves cost
        self._final_step: int | None = None  # the step of the last save of a fit (its cost is no save's cost)
        self._first_step: int | None = None  # and of its first
        self._skipped_this_fit = 0
        # resumable state
        self.last_saved_step = -1
        self.saves = 0
        self.skipped = 0
        # per-fit state
        self._stager = Stager()
        self._snapshot: Snapshot | None = None  # staged, its late copy not yet settled and verified
        self._verify_after: int | None = None  # the step of a snapshot to verify at the next boundary (every rank)
        self._copy_at_boundary: set[int] = set()  # storages seen changing before settle: never copied late again
        self._settle_before_backward = False
        self._writer: CheckpointWriter | None = None
        self._last_save_time = time.monotonic()
        self._steps_seen = 0
        self._best_model_path = ""
        self._patches = Patches()
        self._crashed = False
        self._group: Any | None = None
        self._owner: OwnerLock | None = None  # rank 0, during fit: this job owns dirpath
        self._listeners: list[CheckpointListener] = []
        # cadence: measured on every rank; rank 0 decides, every rank saves at the step it decided
        self.cadence = CadenceTracker(max_interval_s=60 * self.max_interval_minutes)
        self.decision: CadenceDecision | None = None
        self._next_save_step = FIRST_SAVE_STEPS
        self._batch_start: float | None = None
        self._last_step_end: float | None = None
        self._past_failures = 0
        self._fit_start = time.time()

    @property
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self.dirpath))

    # ------------------------------------------------------------------ set-up and resume
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        collective = callable(getattr(trainer.strategy, "dcp_checkpoint_tensors", None))
        if not collective and not isinstance(trainer.strategy.checkpoint_io, _DirectoryAwareIO):
            # Kept after fit too: validate/test(ckpt_path=<one of ours>) must load it as well.
            trainer.strategy.checkpoint_io = _DirectoryAwareIO(trainer.strategy.checkpoint_io)
        if stage != "fit":
            return
        self.dirpath = self.dirpath.absolute()
        self._agree_or_raise(trainer, writable_dir_error(self.dirpath, "AsyncCheckpoint(dirpath", trainer.global_rank),
                             "writing to its dirpath failed")
        self._own_directory(trainer)  # before anything in it is cleaned up or resumed from
        cleanup_error = self._clean_up_after_a_crash() if trainer.is_global_zero else None
        self._agree_or_raise(trainer, cleanup_error, "cleaning up its dirpath failed")
        group = None
        if collective and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            group = dist.new_group(backend="gloo")  # the writer's collectives never meet training's
        self._group = group
        self._writer = CheckpointWriter(self.dirpath, trainer.global_rank, collective, group, self.keep_last_n,
                                        device=trainer.strategy.root_device)
        self._writer.manifest_fields = self._manifest_fields  # (a second fit on this Trainer goes on the first's line)
        self._full_bytes = self._chain_bytes = self._deltas_in_chain = self._last_delta_bytes = 0
        self._since_full_bytes = 0
        self._durable_said_at, self._durable_unsaid, self._newest_durable = None, 0, None
        self._final_step, self._first_step, self._skipped_this_fit = None, None, 0
        if self.incremental and not collective:
            rank_zero_warn(f"AsyncCheckpoint(incremental=True): {type(trainer.strategy).__name__} holds no sharded "
                           "tables, so every save is full. Incremental saves need ETTStrategy.")
        self._crashed = False
        self._last_save_time = time.monotonic()
        self._last_step_end = self._batch_start = None  # (best_model_path kept: a later fit may save nothing)
        self._fit_start = time.time()
        if self.mtbf_hours is None and trainer.is_global_zero:
            self._past_failures = _past_failures()
        if self.resume:
            self._patch_resume(trainer)
        trainer.strategy.barrier("AsyncCheckpoint.setup")  # stale .tmp directories are gone everywhere

    def _own_directory(self, trainer: pl.Trainer) -> None:
        """One live job per dirpath: rank 0 takes its lock (``.ett-owner``); if it cannot, every rank raises.

        Two jobs writing one directory would resume from and overwrite each other's checkpoints.
        This job's previous attempt (an earlier attempt number of the same job id) is taken over
        quietly; an owner that is gone, with a warning (:mod:`lightning_ett.durable.ownership`).
        """
        self._owner = own_directory(
            trainer, self.dirpath, CHECKPOINT_OWNER_FILE, "AsyncCheckpoint",
            fix="Stop that job first, or give this one a dirpath of its own (to start from the other's weights, pass "
                "one of its checkpoints as fit(ckpt_path=...)).", on_takeover=self._warn_takeover, held=self._owner)

    def _warn_takeover(self, sentence: str) -> None:
        """Another job's stale directory: say also what this job will start from (its checkpoints, by default)."""
        newest = fmt.committed(self.dirpath)[-1:] if self.resume else []
        if newest:
            sentence += (f" Unless fit(ckpt_path=...) names another checkpoint, this job resumes from the newest complete "
                         f"one here (at most {newest[0].path.name}); pass AsyncCheckpoint(resume=False) or another "
                         "dirpath to start afresh.")
        rank_zero_warn(sentence)

    def _clean_up_after_a_crash(self) -> OSError | None:
        """Rank 0: settle what a crashed attempt left (``.tmp``, ``.deleting``, ``.replaced``) and its publisher's pins."""
        try:
            for said in remove_stale(self.dirpath, fmt.STEP_PATTERN, fmt.FORMAT):
                rank_zero_info(f"AsyncCheckpoint: {said}")
            for pin in self.dirpath.glob(f"step-*/{fmt.PIN_FILE}"):
                pin.unlink(missing_ok=True)  # a publisher of a crashed attempt held it; retention may take it again
        except OSError as e:
            return OSError(e.errno, f"AsyncCheckpoint: cleaning up {str(self.dirpath)!r} after a crash failed: "
                                    f"{explain(e)}")
        return None

    def _patch_resume(self, trainer: pl.Trainer) -> None:
        """Resume from the newest complete checkpoint when ``fit`` was given no ``ckpt_path``.

        Lightning passes ``ckpt_path`` to ``resume_start`` (on every rank, at the same point);
        the choice is made there. Only a fresh start (global step 0) resumes: a second ``fit``
        on the same Trainer without a ``ckpt_path`` continues as is. An explicit ``ckpt_path`` is
        where a fit begins: a later start of that fit under ``lightning run`` (a restart, a
        relaunch into the job's run dir: another process) resumes from what the job committed in
        a fit begun from that ``ckpt_path``, if anything (going back would re-run every step since,
        at every restart), and costs no verification otherwise. Only the fit's own restore is
        chosen here: Lightning's tuners (``lr_find``, ``scale_batch_size``) restore their own
        temporary checkpoints through ``resume_start`` later in the fit.
        """
        connector = trainer._checkpoint_connector
        original = connector.resume_start
        chosen = False  # (this fit's restore: the patch is installed at each fit's setup)

        def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
            nonlocal chosen
            fresh = trainer.global_step == 0  # (a later fit on this Trainer without a ckpt_path goes on as is)
            if trainer.state.fn == "fit" and not chosen and (fresh or checkpoint_path):
                chosen = True
                if checkpoint_path and trainer.is_global_zero:
                    self._warn_if_another_line_here(checkpoint_path)
                job = launched_job()
                # What every checkpoint of this fit says it began from, and which process wrote it (a second fit in
                # this process from the same ckpt_path begins from it again: only a later process continues).
                began = [job, _as_begun_from(checkpoint_path)] if job and checkpoint_path else None
                self._manifest_fields = {"began": began, "process": _this_process()} if began else {}
                if self._writer is not None:
                    self._writer.manifest_fields = self._manifest_fields
                ours = (self._select_resume_checkpoint(trainer) if not checkpoint_path
                        # (torchrun, or no launcher: ckpt_path as given, the same on every rank)
                        else self._progress_of_this_job(trainer, checkpoint_path, tuple(began)) if began is not None
                        else None)
                if ours is not None:  # (every rank has it: a fit that resumes at its end saves nothing more)
                    self._best_model_path = ours
                    try:
                        return original(ours, weights_only=weights_only)
                    except OSError as e:  # (a checkpoint rank 0 verified that this rank's storage may not show yet)
                        setattr(e, CHOSEN_CHECKPOINT_ATTR, True)
                        raise
                if checkpoint_path and _inside(checkpoint_path, self.dirpath):  # one of ours, named by the user
                    self._best_model_path = str(checkpoint_path)
            original(checkpoint_path, weights_only=weights_only)

        self._patches.setattr(connector, "resume_start", resume_start)

    def _warn_if_another_line_here(self, ckpt_path: Any) -> None:
        """A fit that begins from anything but the newest checkpoint of a dirpath an earlier fit of this process wrote
        to (a loop of fits from one pretrained checkpoint into one dirpath): its checkpoints and the earlier fit's are
        one line (step names, retention, the newest wins), so a restart of the script may resume one fit from the
        other's. A fit continuing from the newest (the next stage from the last checkpoint) is that line going on."""
        if str(self.dirpath) not in _committed_here or "://" in str(ckpt_path):
            return
        try:
            entries = fmt.committed(self.dirpath)
        except OSError:  # (rank 0 alone: no error here may keep it from the broadcast the other ranks wait in)
            return
        if entries and os.path.realpath(entries[-1].path) == os.path.realpath(ckpt_path):
            return
        rank_zero_warn(f"AsyncCheckpoint: an earlier fit of this process saved into {str(self.dirpath)!r}, and this fit "
                       f"begins from another checkpoint ({str(ckpt_path)!r}): the checkpoints of one dirpath are one line "
                       "(their step names and retention are shared), so after a restart of the script a fit may resume "
                       "from another's. Give each fit of a loop its own dirpath.")

    def _progress_of_this_job(self, trainer: pl.Trainer, ckpt_path: Any, began: tuple[str, ...]) -> str | None:
        """Under ``lightning run``: the newest complete checkpoint this job committed, in an earlier process, in a fit
        begun from the same ``ckpt_path`` (``began``), if any (a restart, a relaunch into the job's run dir). Another
        ``ckpt_path`` (a roll-back, the next stage of a multi-stage script) or another job finds none. Rank 0 decides
        and every rank takes its answer: no rank decides alone, so none waits for a broadcast alone."""
        path = self._select_resume_checkpoint(trainer, began=began)
        step = fmt.step_of(path) if path is not None else None
        if step is not None and 0 < trainer.max_steps <= step:
            rank_zero_info(f"AsyncCheckpoint: this job's fit begun from fit(ckpt_path={str(ckpt_path)!r}) had already "
                           f"reached max_steps={trainer.max_steps} ({path}): it resumes there and trains nothing more "
                           "(a restart of a script whose earlier fits were done, or a relaunch of a finished job into its "
                           "run dir; to train again from ckpt_path, start a new job with another --run-dir or --job-id, "
                           "or pass AsyncCheckpoint(resume=False)).")
        elif path is not None:
            rank_zero_warn(f"AsyncCheckpoint: this job began from fit(ckpt_path={str(ckpt_path)!r}) and has trained "
                           f"since: it resumes from {path}, the newest checkpoint it committed from there (going back "
                           "would re-run every step since). To begin from ckpt_path again, pass another ckpt_path, "
                           "start a new job (another --run-dir or --job-id), or pass AsyncCheckpoint(resume=False).")
        return path

    def _select_resume_checkpoint(self, trainer: pl.Trainer, began: tuple[str, ...] | None = None) -> str | None:
        """Rank 0 verifies, every rank gets its answer (or its error).

        ``began``: only a checkpoint whose manifest says it was committed by that job, in an earlier process,
        in a fit begun from that ``ckpt_path`` (the others are not verified).
        """
        answer: tuple[str | None, str | None] = (None, None)
        if trainer.is_global_zero:
            start = time.time()
            try:
                found = fmt.newest_complete(self.dirpath, checksums=self.verify_checksums, began=began,
                                            not_by=_this_process() if began is not None else None)
                answer = (str(found) if found is not None else None, None)
                if found is not None:
                    get_timeline().record(Phase.CHECKPOINT_LOAD, start, time.time())  # verification is part of the load
            except Exception as e:  # noqa: BLE001 - re-raised on every rank below
                answer = (None, repr(e))
        path, error = trainer.strategy.broadcast(answer, src=0)
        if error is not None:
            raise RuntimeError(f"AsyncCheckpoint: looking for a checkpoint to resume from in {str(self.dirpath)!r} "
                               f"failed: {error}")
        if path is not None:
            rank_zero_info(f"AsyncCheckpoint: resuming from the newest complete checkpoint {path}")
        return path

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._settle_before_backward = _mutates_in_backward(trainer)  # the strategy has wrapped the model by now
        if trainer.global_step > 0:  # resumed: the restored step is saved already
            self.last_saved_step = max(self.last_saved_step, trainer.global_step)
        if self.auto:
            # A restart keeps the measured save cost (state_dict): no measuring save needed again.
            decision = self._decide() if trainer.is_global_zero else None
            interval = decision.interval_steps if decision is not None else FIRST_SAVE_STEPS
            self._next_save_step = trainer.global_step + int(trainer.strategy.broadcast(interval, src=0))

    def add_listener(self, listener: CheckpointListener) -> None:
        """Have ``listener`` hear of every snapshot (all ranks) and every committed checkpoint (rank 0)."""
        if listener not in self._listeners:
            self._listeners.append(listener)

    def remove_listener(self, listener: CheckpointListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def release(self, path: Path) -> None:
        """A listener is done with the checkpoint at ``path`` (it unpinned it): apply retention now.

        Global rank 0. Deleting checkpoints takes seconds on network filesystems: a thread does it.
        """
        if self._writer is not None and self._writer.rank == 0:
            self._writer.apply_retention_in_background()

    @property
    def best_model_path(self) -> str:
        """The newest checkpoint this callback made durable (saves are not ranked by a metric)."""
        return self._best_model_path

    # ------------------------------------------------------------------ saving
    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self._batch_start is None:  # the first batch of this optimizer step (gradient accumulation)
            self._batch_start = time.perf_counter()

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        if self._settle_before_backward:
            self._settle()  # TorchRec's fused optimizer updates the tables inside backward

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._settle()

    def _settle(self) -> None:
        """Before the first mutation after a snapshot: wait for (CPU) or order after (CUDA) its late copy."""
        if self._snapshot is not None:
            self._snapshot.settle()

    def _verify_last_snapshot(self, trainer: pl.Trainer) -> None:
        """At the boundary after a save: if on any rank a tensor changed before it was copied, save again now."""
        snapshot, self._snapshot, self._verify_after = self._snapshot, None, None
        changed = snapshot.settle() if snapshot is not None else []
        (void,) = self._agree(trainer, bool(changed))
        if not void:
            return
        if snapshot is not None:
            self._copy_at_boundary |= snapshot.changed_storages
        if changed:
            warnings.warn(f"AsyncCheckpoint: {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} changed before "
                          f"the snapshot of step {self.last_saved_step} had copied {'it' if len(changed) == 1 else 'them'} "
                          "(an in-place update after the step, e.g. in forward); that snapshot was dropped and step "
                          f"{trainer.global_step} is saved instead, with {'it' if len(changed) == 1 else 'them'} copied at "
                          "the boundary from now on.", stacklevel=1)
        self.saves -= 1
        self._wait_agreed(trainer)  # the dropped save ends at once
        self._save(trainer)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        assert self._writer is not None
        now = time.perf_counter()
        if self._verify_after is not None and trainer.global_step > self._verify_after:
            self._verify_last_snapshot(trainer)
        if accumulating(trainer):
            self._report(trainer, self._writer.poll())
            return  # not a step boundary: gradients of this optimizer step are still being accumulated
        if self._batch_start is not None:
            wall = now - self._last_step_end if self._last_step_end is not None else None
            slower = self.cadence.observe_step(now - self._batch_start, wall, writing=self._writer.busy)
            if slower > 0:  # the write's share of this step is checkpoint cost, not effective training
                get_timeline().carve(Phase.CHECKPOINT_SAVE, slower, within=Phase.TRAIN, step=trainer.global_step)
        self._batch_start = None
        self._report(trainer, self._writer.poll())
        self._steps_seen += 1
        if self._due(trainer):
            self._save(trainer)
        self._last_step_end = time.perf_counter()  # a save's blocked time is its cost, not a slow step

    def _due(self, trainer: pl.Trainer) -> bool:
        step = trainer.global_step
        if step == self.last_saved_step:
            return False
        if self.auto:
            return step >= self._next_save_step
        if self.every_n_train_steps is not None:
            return step % self.every_n_train_steps == 0
        assert self.every_n_minutes is not None
        elapsed = time.monotonic() - self._last_save_time >= 60 * self.every_n_minutes
        if trainer.world_size == 1:
            return elapsed
        if self._steps_seen % _TIME_CHECK_EVERY:
            return False
        return bool(trainer.strategy.broadcast(elapsed, src=0))  # every rank saves at the same step

    def _save(self, trainer: pl.Trainer, final: bool = False) -> None:
        """Snapshot and hand to the writer. Every decision here is the same on every rank."""
        assert self._writer is not None
        step = trainer.global_step
        start = time.perf_counter()
        with record_phase(Phase.CHECKPOINT_SAVE, step):
            self._report(trainer, self._writer.poll())  # one that finished since this step's poll: the chain counts it
            busy, error = self._writer.status()
            interval = 0.0
            if self.auto and trainer.is_global_zero:
                interval = float(self.decision.interval_steps if self.decision is not None else FIRST_SAVE_STEPS)
            busy, failed, interval = self._agree(trainer, busy, error is not None, interval)  # rank 0's interval
            if failed:
                self._writer.wait()  # raises this rank's error, if it has one
                raise CheckpointWriteError(f"The background checkpoint write failed {ANOTHER_RANKS_ERROR}.")
            if self.auto:
                postpone = busy and not final  # an interval shorter than a write: only before the first was measured
                self._next_save_step = step + (1 if postpone else max(int(interval), 1))
                if postpone:
                    return
            last = 0 < trainer.max_steps <= step  # the fit's last step: no steps after it
            if busy and not final and self.when_busy == "skip":
                if last and self.save_on_train_end:
                    return  # not a skip: the end of fit writes this step (a warning here would say it is lost)
                self.skipped += 1
                self._skipped_this_fit += 1
                if self._skipped_this_fit == 1:  # once a fit; the end of fit gives the count
                    rank_zero_warn(f"AsyncCheckpoint: skipping the save of step {step}: the previous save is still "
                                   "being written (when_busy='skip'). Save less often or pass when_busy='wait'. "
                                   "Later skips are counted, not repeated.")
                return
            if busy:
                self._wait_agreed(trainer)
                start = time.perf_counter()  # that wait is the previous save's, not this one's cost (the phase keeps it)
            if final or last:
                self._final_step = step  # (its cost reads as blocked time alone: no steps after it to slow down)
            if self._first_step is None:
                self._first_step = step  # the fit's first save allocates the staging buffers: no typical cost
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            split = getattr(trainer.strategy, "dcp_checkpoint_tensors", None)
            if callable(split):
                tensors = split(checkpoint)  # sharded: every rank writes its part
            else:
                _require_full_copy(trainer, checkpoint.get("state_dict", {}))
                tensors = {"model": checkpoint.pop("state_dict")} if trainer.is_global_zero else None
            if tensors is not None:  # (replicated state: rank 0 writes it all)
                late = self._late_storages(trainer) if self.overlap_staging and not final else set()
                state = {"dcp": tensors, "meta": checkpoint}
                full, budget, rebase_full = True, math.inf, -math.inf
                if self.incremental and callable(split):  # every rank is here; any rank's "full" wins, rank 0's bounds
                    zero = trainer.is_global_zero
                    full, budget, rebase_full = self._agree(
                        trainer, not (self._delta_due(trainer) and self._stager.can_diff(state)),
                        self._delta_budget(trainer) if zero else -math.inf,
                        self._full_bytes if zero and self.full_every_n_saves is None else -math.inf)
                self._snapshot = self._stager.stage(state, late, keep_base=self.incremental, as_delta=not full)
                self._writer.submit(self._snapshot, step, boundary_s=time.perf_counter() - start,
                                    on_committed=self._stager.mark_base if self.incremental else None,
                                    delta_budget=None if math.isinf(budget) else budget,
                                    rebase=None if math.isinf(rebase_full) else Rebase(int(rebase_full),
                                                                                       trainer.world_size))
            self._verify_after = step
            self.cadence.save_started()
        for listener in list(self._listeners):
            listener.on_checkpoint_snapshot(trainer, step)
        self.last_saved_step = step
        self.saves += 1
        self._last_save_time = time.monotonic()

    def _delta_due(self, trainer: pl.Trainer) -> bool:
        """May this save be a delta? This rank holds the last committed save's tables (same layout), and on rank 0
        the chain is short enough (``full_every_n_saves``, else its estimated restore time: ``chain.next_delta_budget``)
        and deltas cost less than full saves (``save_kind``)."""
        if not self._stager.has_base:
            return False
        if not trainer.is_global_zero:
            return True  # rank 0 decides the chain's length; its "full" wins in the agreement
        if self.full_every_n_saves is not None:
            return self._deltas_in_chain + 1 < self.full_every_n_saves
        if not self._kinds.delta_pays():
            return False  # deltas cost about as much as full saves lately (``save_kind``)
        if self._delta_budget(trainer) > self._last_delta_bytes:  # the next one as big as the last: else full now...
            return True
        return Rebase(self._full_bytes, trainer.world_size).pays(  # ... unless a rebase pays (the writer decides)
            self._since_full_bytes + self._last_delta_bytes, self._last_delta_bytes)

    def _count_in_chain(self, result: WriteResult) -> None:
        """Rank 0: what the chain's restore bound counts (``chain.next_delta_budget``): a full save starts a chain;
        a delta adds its files (its dense state does not count: a restore reads only the newest delta's)."""
        if result.rebased:  # the chain restarts from its full save: a restore reads the rebase, then what follows
            self._chain_bytes, self._deltas_in_chain = result.delta_bytes, 1
            self._since_full_bytes = result.since_full_bytes
        elif result.incremental:
            self._chain_bytes += result.delta_bytes
            self._deltas_in_chain += 1
            self._last_delta_bytes = result.delta_bytes
            self._since_full_bytes = result.since_full_bytes
        else:
            self._full_bytes, self._chain_bytes, self._deltas_in_chain, self._last_delta_bytes = result.bytes, 0, 0, 0
            self._since_full_bytes = 0

    def _say_if_never_a_delta(self, trainer: pl.Trainer) -> None:
        """Once: with ``incremental``, why every save is full — no sharded tables, or tables this small
        (``chain.next_delta_budget``)."""
        if not self.incremental or self._said_no_delta or self._writer is None or not self._writer.collective:
            return
        if not self._stager.holds_sharded:
            self._said_no_delta = True
            rank_zero_info("AsyncCheckpoint(incremental=True): every save will be full: the model has no sharded tables "
                           "(data_parallel tables are replicated, saved like dense parameters), so there are no rows to "
                           "write apart (with no tables, incremental=True costs nothing either).")
        elif self.full_every_n_saves is None and self._delta_budget(trainer) <= 0:
            self._said_no_delta = True
            needed = DELTA_OPEN_BYTES_PER_RANK * trainer.world_size / MAX_EXTRA_RESTORE / 2**20
            rank_zero_info(
                f"AsyncCheckpoint(incremental=True): every save will be full: a full save here is "
                f"{self._full_bytes / 2**20:.1f} MiB over {trainer.world_size} ranks, and a chain is kept to what "
                f"restores in {1 + MAX_EXTRA_RESTORE:.1f} full restores, counting {DELTA_OPEN_BYTES_PER_RANK >> 20} MiB "
                f"per rank for each delta's files, so deltas start above {needed:.0f} MiB of full save here (on tables "
                "this small a full save is cheap). full_every_n_saves=N forces deltas; incremental=False frees the second "
                "staging copy of the tables.")

    def _delta_budget(self, trainer: pl.Trainer) -> float:
        """Rank 0: the bytes of rows the next delta may hold before the chain outgrows its bound (inf: no bound)."""
        if self.full_every_n_saves is not None:
            return math.inf
        return next_delta_budget(self._full_bytes, self._chain_bytes, self._deltas_in_chain, trainer.world_size)

    def _late_storages(self, trainer: pl.Trainer) -> set[int]:
        """What may be copied after the boundary: parameters and optimizer states (nothing else changes before
        backward / the optimizer step), minus what was seen changing earlier."""
        owners: list[Any] = [list(trainer.lightning_module.parameters())]
        if trainer.strategy.model is not None and trainer.strategy.model is not trainer.lightning_module:
            owners.append(list(trainer.strategy.model.parameters()))
        owners += [list(optimizer.state.values()) for optimizer in trainer.optimizers]
        fused = getattr(trainer.strategy, "fused_optimizer_instance", None)
        if fused is not None:
            owners.append(list(fused.state.values()))
        return storages(owners) - self._copy_at_boundary

    def _agree(self, trainer: pl.Trainer, *flags: bool | float) -> list[Any]:
        """Each value max-ed over all ranks (flags: OR-ed): one small all-reduce, only when a save is due."""
        return any_rank(trainer, *flags)

    def _agree_or_raise(self, trainer: pl.Trainer, error: BaseException | None, what: str) -> None:
        """Raise on every rank if any rank has an error (a lone raise would leave the others in a collective)."""
        raise_on_every_rank(trainer, error, "AsyncCheckpoint", what)

    def _wait_agreed(self, trainer: pl.Trainer) -> None:
        """Wait for the save in flight; if it failed on any rank, raise on every rank."""
        assert self._writer is not None
        self._settle()  # the writer waits for it
        error: CheckpointWriteError | None = None
        try:
            self._report(trainer, self._writer.wait())
        except CheckpointWriteError as e:
            error = e
        self._agree_or_raise(trainer, error, "writing its part of the checkpoint failed")

    def _report(self, trainer: pl.Trainer, result: WriteResult | None) -> None:
        if result is None:
            return
        self._best_model_path = str(result.path)
        _committed_here.add(str(self.dirpath))
        get_timeline().fact(CHECKPOINT_FACT, step=result.step, path=str(result.path), incremental=result.incremental,
                            rebase=result.rebased)
        blocked = result.blocked_s
        metrics = {"checkpoint/write_s": result.seconds, "checkpoint/blocked_s": blocked,
                   "checkpoint/staging_bytes": float(self._stager.nbytes), "checkpoint/bytes": float(result.bytes),
                   "checkpoint/overlapped_bytes": float(result.overlapped_bytes)}
        outgrew_bound = result.over_budget and self._deltas_in_chain == 0  # (not a chain's natural end)
        self._count_in_chain(result)
        if result.incremental:
            metrics["checkpoint/rows_changed_fraction"] = result.rows_changed / max(result.rows_compared, 1)
        else:
            self._say_if_never_a_delta(trainer)
        metrics["checkpoint/incremental"] = float(result.incremental)
        metrics["checkpoint/rebase"] = float(result.rebased)
        # (settle's wait is in a timed step already; a fit's first save allocates the buffers: once a fit, not a save)
        cost = self.cadence.observe_save(result.boundary_s, result.seconds, typical=result.step != self._first_step)
        metrics["checkpoint/save_cost_s"] = cost
        if self.incremental and self.full_every_n_saves is None and result.step != self._final_step \
                and not result.rebased:  # (a rebase holds many intervals' rows: no delta's cost, nor a full save's)
            # (the last save of a fit has no steps after it to slow down: its cost would read as blocked time alone)
            typical = not result.over_budget and result.step != self._first_step
            why = self._kinds.observe(result.incremental, cost, outgrew_bound, typical)
            if why:
                rank_zero_info(f"AsyncCheckpoint(incremental=True): {why}.")
        decision = self._decide()
        if decision is not None:
            fields = {"mode": "auto" if self.auto else "fixed", **decision.to_fields()}
            metrics["checkpoint/interval_steps"] = float(decision.interval_steps)
            if not mtbf_is_assumed(fields):  # (a failure cost from an assumed MTBF is no measurement: not charted)
                metrics.update({"checkpoint/expected_loss_per_failure_s": decision.expected_loss_per_failure_s,
                                "checkpoint/predicted_overhead": decision.predicted_overhead})
            get_timeline().fact(CADENCE_FACT, **fields)
        log_to_loggers(trainer, metrics)
        kind = (f"a delta: {result.rows_changed} of {result.rows_compared} rows of the tables and their optimizer state, "
                if result.incremental else "")
        if result.rebased:
            kind = ("a rebase on the last full save: every row changed since it (a restore no longer reads the deltas "
                    "before), ")
        now = time.monotonic()
        said = (self.verbose or self._durable_said_at is None or result.step == self._final_step
                or now - self._durable_said_at >= QUIET_LINE_EVERY_S)
        if said:
            since = f"; {self._durable_unsaid} more durable since the last line" if self._durable_unsaid else ""
            rank_zero_info(f"AsyncCheckpoint: step {result.step} is durable at {result.path} ({kind}"
                           f"{result.bytes / 2**20:.1f} MiB; "
                           f"training blocked {blocked:.3f} s, written in the background in {result.seconds:.2f} s; "
                           f"staging buffers {self._stager.nbytes / 2**20:.1f} MiB, of which "
                           f"{result.overlapped_bytes / 2**20:.1f} MiB copied while the next step ran{since})")
            self._durable_said_at, self._durable_unsaid = now, 0
        else:
            self._durable_unsaid += 1
        self._newest_durable = (result.step, result.path)
        if self.auto and decision is not None and said:  # (with the save's line: the cadence is logged at every save)
            self._log_decision(decision)
        for listener in list(self._listeners):
            listener.on_checkpoint_durable(trainer, result.path, result.step)

    # ------------------------------------------------------------------ cadence
    def _mtbf(self) -> tuple[float, str]:
        if self.mtbf_hours is not None:
            return 3600 * self.mtbf_hours, "given"
        job_start = float(os.environ.get(ENV_JOB_START, "0") or 0) or self._fit_start  # without a launcher: this fit
        return estimate_mtbf_s(self._past_failures, time.time() - job_start)

    def _decide(self) -> CadenceDecision | None:
        """Rank 0's view of the cadence: the Young/Daly choice (``"auto"``), or the fixed interval described."""
        mtbf_s, source = self._mtbf()
        if self.auto:
            self.decision = self.cadence.decide(mtbf_s, source) or self.decision
            return self.decision
        if isinstance(self.every_n_train_steps, int):
            return self.cadence.describe(self.every_n_train_steps, mtbf_s, source)
        step = self.cadence.step_s
        if self.every_n_minutes is not None and step:
            return self.cadence.describe(max(1, round(60 * self.every_n_minutes / step)), mtbf_s, source)
        return None

    def _log_decision(self, d: CadenceDecision) -> None:
        bound = f" (held at its {d.bound}imum)" if d.bound else ""
        rank_zero_info(f"AsyncCheckpoint(every_n_train_steps='auto'){bound}: {cadence_line({'mode': 'auto', **d.to_fields()})}")

    # ------------------------------------------------------------------ end of fit, failures
    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self._writer is not None
        if self.save_on_train_end and trainer.global_step != self.last_saved_step:
            self._save(trainer, final=True)
        with record_phase(Phase.CHECKPOINT_SAVE, trainer.global_step):
            self._wait_agreed(trainer)  # the job is not done before its last save is durable
        if trainer.world_size > 1:  # rank 0 saw the commits: every rank's best_model_path, as ModelCheckpoint's is
            self._best_model_path = trainer.strategy.broadcast(self._best_model_path, src=0)
        self._say_unsaid()
        if self._skipped_this_fit > 1:
            rank_zero_warn(f"AsyncCheckpoint: {self._skipped_this_fit} saves were skipped in this fit: the previous save "
                           "was still being written each time (when_busy='skip'). Save less often or pass "
                           "when_busy='wait'.")

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Keep what can be kept; never hide the training error. (Lightning calls no ``teardown`` after one.)"""
        self._crashed = True
        if self._writer is not None:
            try:
                if isinstance(exception, SIGTERMException) and self.save_on_train_end \
                        and trainer.global_step != self.last_saved_step:
                    # Preemption: every rank stops after the same batch, so a last save is possible.
                    self._save(trainer, final=True)
                    self._wait_agreed(trainer)
                else:
                    self._settle()
                    self._writer.wait(timeout=_EXCEPTION_WAIT_S)  # a save in flight may still complete
            except CommittedUnconfirmedError as e:  # complete: a resume starts from it
                rank_zero_warn(f"AsyncCheckpoint: the save in flight when training failed: {e}")
            except Exception as e:  # noqa: BLE001 - the training error is the one to raise; report this one
                rank_zero_warn(f"AsyncCheckpoint: the save in flight when training failed did not finish on every rank: "
                               f"{e}")
        self._say_unsaid()
        self._cleanup()

    def _say_unsaid(self) -> None:
        """At a fit's end: the saves made durable since the console's last line, if any (the fit may end without a
        final save: it stopped at a saved step, by max_epochs or EarlyStopping, or failed)."""
        if self._durable_unsaid and self._newest_durable is not None:
            step, path = self._newest_durable
            rank_zero_info(f"AsyncCheckpoint: {self._durable_unsaid} more saves durable since the last line; the newest, "
                           f"step {step}, at {path}")
            self._durable_unsaid = 0

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._cleanup()

    def _cleanup(self) -> None:
        self._settle()  # a writer thread still waiting for it may finish
        self._snapshot, self._verify_after = None, None
        self._patches.undo()
        if self._writer is not None:
            self._writer.close()
        self._writer = None
        self._stager.release()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None
        if self._owner is not None:  # the writer is closed: nothing more goes into dirpath
            self._owner.release()
            self._owner = None

    # ------------------------------------------------------------------ state
    @override
    def state_dict(self) -> dict[str, Any]:
        return {"dirpath": str(self.dirpath), "last_saved_step": self.last_saved_step, "saves": self.saves,
                "skipped": self.skipped,
                "cadence": self.cadence.state_dict(), "save_kinds": self._kinds.state_dict()}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_saved_step = int(state_dict.get("last_saved_step", -1))
        self.saves = int(state_dict.get("saves", 0))
        self.skipped = int(state_dict.get("skipped", 0))
        self.cadence.load_state_dict(state_dict.get("cadence", {}))
        self._kinds.load_state_dict(state_dict.get("save_kinds", {}))


def _past_failures() -> int:
    """Failed earlier attempts of this job, from its ledger (0 without one)."""
    run_dir = os.environ.get(ENV_RUN_DIR)
    if not run_dir:
        return 0
    try:
        return failed_attempts(run_dir, before=int(os.environ.get(ENV_ATTEMPT, "0") or 0))
    except (OSError, ValueError):
        return 0


_EXCEPTION_WAIT_S = 120.0  # after a crash, a save in flight gets this long to finish (a dead peer may block it)


def _require_full_copy(trainer: pl.Trainer, state_dict: dict[str, Any]) -> None:
    """Rank 0 writes alone only if it holds the whole model; sharded state needs a collective writer."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor
    from torch.distributed.tensor import DTensor

    if any(isinstance(v, (ShardedTensor, DTensor)) for v in state_dict.values()):
        raise ConfigurationTypeError(
            f"AsyncCheckpoint: {type(trainer.strategy).__name__} shards the model's state, and AsyncCheckpoint writes "
            "sharded state only with ETTStrategy (or a strategy with `dcp_checkpoint_tensors`). Use ETTStrategy, or a "
            "strategy that keeps a full copy of the model on every rank (single device, DDP)."
            )


def _mutates_in_backward(trainer: pl.Trainer) -> bool:
    """Does backward change parameters? (TorchRec: an optimizer applied in backward, or fused into the tables.)"""
    if getattr(trainer.strategy, "fused_optimizer_instance", None) is not None:
        return True
    modules = [trainer.lightning_module] + ([trainer.strategy.model] if trainer.strategy.model is not None else [])
    if any(hasattr(p, "_in_backward_optimizers") for m in modules for p in m.parameters()):
        return True
    try:
        from torchrec.optim.fused import FusedOptimizerModule
    except ImportError:
        return False
    return any(isinstance(sub, FusedOptimizerModule) for m in modules for sub in m.modules())


class _DirectoryAwareIO(CheckpointIO):
    """The strategy's CheckpointIO, plus loading of AsyncCheckpoint directories (non-sharded strategies)."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict[str, Any]:
        if fmt.looks_like_checkpoint(path):
            with record_phase(Phase.CHECKPOINT_LOAD):
                return fmt.load_unsharded(path)
        try:
            return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except IsADirectoryError as e:  # (a directory another CheckpointIO reads is its own business)
            raise IsADirectoryError(e.errno, fmt.not_a_checkpoint(path)) from e  # say what it is, and which to pass

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


__all__ = ["AsyncCheckpoint", "CheckpointListener", "CheckpointWriteError"]
