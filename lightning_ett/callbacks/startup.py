"""Start-up phases Lightning has no hook for, each timed in the component that spends it.

Lightning's first callback hook (``setup``) comes after the Trainer is built, its launcher has
run, the process group has formed and every logger has created its experiment (W&B's run
init: about 1.7 s offline on 2 cores, more online). A callback alone can time only all of them
together, and before this module ETTMonitor charged that sum to ``process_group_init``.
:class:`StartupProbe` times each one where it runs:

* ``trainer_init``: ``Trainer.__init__`` of the Trainer that holds the monitor. A class-level
  wrapper finds it: installed when a monitor is built, removed once its Trainer exists.
* ``lightning_launcher``: Lightning's launcher, from ``launch`` until it calls the fit function.
  Under its own subprocess launcher this is where the other ranks are started.
* ``process_group_init``: ``strategy.setup_environment``, which selects the device and forms the
  process group. ETTStrategy's work overlapped with it records phases of its own.
* ``logger_init``: the loggers' experiment creation and ``log_hyperparams``.
* ``data_init``: ``prepare_data`` and ``LightningDataModule.setup``.

The loggers also leave the critical path. Their experiments are created in a background thread
from the start of ``setup_environment`` and joined at its end, so W&B's run init overlaps the
process group and, under ETTStrategy, model init. Lightning then finds every experiment created
and goes on as it would, so what the user sees in W&B does not change.

This works on strategies whose launcher runs the fit function in this process (the default
subprocess launcher, torchrun, ``lightning run``, one device). Under ``ddp_spawn`` the
Trainer is pickled into new processes, so no instance is wrapped there. Those phases then stay in
``other``.
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

from lightning_ett.instrument.background import BackgroundTask
from lightning_ett.instrument.timeline import Phase, get_timeline, record_phase
from lightning_ett.patching import Patches


class StartupProbe:
    """Times one Trainer's start-up for ``owner`` (a callback) and starts its loggers in the background.

    ``on_loggers`` runs just before the loggers create their experiments (ETTMonitor names the
    job's W&B run there). The instance wrappers go into ``patches``, which the owner undoes in
    ``teardown``.
    """

    def __init__(self, owner: Any, patches: Patches, on_loggers: Callable[[list[Logger]], None]) -> None:
        self._owner = weakref.ref(owner)
        self._patches = patches
        self._on_loggers = on_loggers
        self._loggers_task: BackgroundTask | None = None
        _WAITING.add(self)
        _install_trainer_init_wrapper()

    def _belongs_to(self, trainer: pl.Trainer) -> bool:
        owner = self._owner()
        return owner is not None and any(callback is owner for callback in trainer.callbacks)

    def attach(self, trainer: pl.Trainer, init_start: float, init_end: float) -> None:
        """Record ``trainer_init`` and wrap what runs before the first hook."""
        get_timeline().record(Phase.TRAINER_INIT, init_start, init_end)
        strategy = trainer.strategy
        launcher = strategy.launcher
        if launcher is not None and not isinstance(launcher, _SubprocessScriptLauncher):
            return  # a spawning launcher pickles the Trainer: leave it unwrapped (see the module docstring)
        if launcher is not None:
            self._patches.setattr(launcher, "launch", _timed_launch(launcher.launch))
        self._patches.setattr(strategy, "setup_environment", self._setup_environment(trainer, strategy.setup_environment))
        connector = trainer._data_connector
        self._patches.setattr(connector, "prepare_data", record_phase(Phase.DATA_INIT)(connector.prepare_data))
        for logger in trainer.loggers:
            self._patches.setattr(logger, "log_hyperparams", record_phase(Phase.LOGGER_INIT)(logger.log_hyperparams))

    def _setup_environment(self, trainer: pl.Trainer, original: Callable[[], None]) -> Callable[[], None]:
        @functools.wraps(original)
        def setup_environment() -> None:
            start = time.time()
            datamodule = trainer.datamodule
            if datamodule is not None:
                self._patches.setattr(datamodule, "setup", record_phase(Phase.DATA_INIT)(datamodule.setup))
            set_world_ranks = getattr(trainer.strategy, "set_world_ranks", None)
            if callable(set_world_ranks):
                set_world_ranks()  # rank_zero_only.rank must be right before a logger creates its experiment
            if trainer.loggers:
                self._on_loggers(trainer.loggers)
                self._loggers_task = BackgroundTask(functools.partial(_create_experiments, trainer.loggers),
                                                    Phase.LOGGER_INIT, name="ett-logger-init")
            try:
                original()
            finally:
                if self._loggers_task is not None:
                    self._loggers_task.join()
                    self._loggers_task = None
                get_timeline().record(Phase.PROCESS_GROUP_INIT, start, time.time())

        return setup_environment


def _create_experiments(loggers: list[Logger]) -> None:
    """What Lightning's ``_call_setup_hook`` does first: W&B before the others (it must see TensorBoard's writers)."""
    for logger in sorted(loggers, key=lambda lg: not isinstance(lg, WandbLogger)):
        if hasattr(logger, "experiment"):  # the property creates the experiment
            pass


def _timed_launch(launch: Callable[..., Any]) -> Callable[..., Any]:
    """The launcher's own time: from ``launch`` until it calls the function it launches."""

    @functools.wraps(launch)
    def timed_launch(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        start = time.time()

        @functools.wraps(function)
        def launched(*fargs: Any, **fkwargs: Any) -> Any:
            get_timeline().record(Phase.LIGHTNING_LAUNCHER, start, time.time())
            return function(*fargs, **fkwargs)

        return launch(launched, *args, **kwargs)

    return timed_launch


# ---------------------------------------------------------------- finding the Trainer
_WAITING: weakref.WeakSet[StartupProbe] = weakref.WeakSet()
_CLASS_PATCH = Patches()


def _install_trainer_init_wrapper() -> None:
    """Wrap ``Trainer.__init__`` while some probe waits for its Trainer (Lightning has no init hook)."""
    if len(_CLASS_PATCH):
        return
    original = pl.Trainer.__init__

    @functools.wraps(original)
    def __init__(trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        start = time.time()
        original(trainer, *args, **kwargs)
        end = time.time()
        for probe in list(_WAITING):
            if probe._belongs_to(trainer):
                _WAITING.discard(probe)
                probe.attach(trainer, start, end)
        if not _WAITING:
            _CLASS_PATCH.undo()

    _CLASS_PATCH.setattr(pl.Trainer, "__init__", __init__)
