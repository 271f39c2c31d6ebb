"""``lightning-ett tune``: check everything that can be checked, then search, then write what was found.

Before any trial: the space parses and no option has an empty list; the budget shows every
value once; ``--out`` is writable (and, resumed, holds a tune of the same space and settings);
every option name exists in the script's LightningCLI configuration (read with the script's own
``--print_config``, close matches listed); ``--objective ett`` has its hours, an MTBF (stated or
from a ledger) and a script that checkpoints with AsyncCheckpoint. A trial then adds ETTMonitor
when the script's configuration has none (its ledger is the measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console

from lightning_ett.durable.files import atomic_write_text, writable_dir_error
from lightning_ett.tune.measure import Measurement
from lightning_ett.tune.objective import OBJECTIVES, mtbf_hours_from, score
from lightning_ett.tune.samplers import DEFAULT_SAMPLER, SAMPLERS
from lightning_ett.tune.space import Space, SpaceError
from lightning_ett.tune.trials import Trial, TrialLog, TrialRunner, absolute_paths

if TYPE_CHECKING:
    from lightning_ett.tune.search import RoundReport

SUBCOMMANDS = ("fit", "validate", "test", "predict")
SCRIPT_CONFIG_FILE = "script_config.yaml"
ETT_MONITOR = "lightning_ett.ETTMonitor"
CONTROLLED = {"trainer.max_steps": "--steps", "trainer.devices": "--devices"}  # options each trial sets itself


class TuneError(ValueError):
    """Bad input, found before any trial ran."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    tune = sub.add_parser(
        "tune", help="Find the fastest settings of a LightningCLI script's knobs in a few real trials, with an ML proxy.",
        description="Each trial is `lightning run` of SCRIPT for --steps steps with one configuration of the options "
        "in --space; Optuna's TPE picks the next ones (or our proxy, or random: --sampler), then the best few run "
        "--confirm-runs more times and the best median wins; a proxy fitted on the trials reports predicted vs measured. "
        "In all, --budget + "
        "--confirm-top x --confirm-runs trials. Arguments after `--`, and any this command does not know, go to SCRIPT "
        "(its LightningCLI subcommand, `fit`, is added if missing).",
    )
    tune.add_argument("script", metavar="SCRIPT", help="A LightningCLI script (e.g. examples/dlrm_example.py).")
    tune.add_argument("--space", required=True, metavar="SPACE.yaml",
                      help="LightningCLI option names mapped to the values to try, e.g. `data.batch_size: [256, 512]`.")
    tune.add_argument("--budget", required=True, type=int, metavar="N",
                      help="Configurations to try, one trial each (the confirmation's re-runs come on top).")
    tune.add_argument("--steps", required=True, type=int, metavar="M", help="Training steps per trial.")
    tune.add_argument("--out", required=True, metavar="DIR", help="trials.json, best.yaml, tune_report.png, trial dirs. "
                      "Run again with the same DIR to continue a tune.")
    tune.add_argument("--devices", type=int, default=1, metavar="D", help="Processes per trial (default 1).")
    tune.add_argument("--objective", choices=OBJECTIVES, default="throughput",
                      help="throughput: steady training samples/s; ett: samples trained per hour of a --job-hours "
                      "job's wall time, with the trial's start-up, save cost and cadence, failing every --mtbf-hours.")
    tune.add_argument("--job-hours", type=float, default=None, help="--objective ett: the job's training hours.")
    tune.add_argument("--mtbf-hours", type=float, default=None, help="--objective ett: hours between failures.")
    tune.add_argument("--mtbf-from", default=None, metavar="RUN_DIR",
                      help="--objective ett: read the MTBF from a previous job's ETT ledger instead of --mtbf-hours.")
    tune.add_argument("--sampler", choices=SAMPLERS, default=DEFAULT_SAMPLER,
                      help="Who picks the configurations: tpe (Optuna's TPE, the default: it beat the proxy on the "
                      "held-out benchmark), proxy (ours: a D-optimal design, then a Gaussian process), random.")
    tune.add_argument("--confirm-top", type=int, default=2, metavar="K",
                      help="Configurations with the best median re-run at the end (default 2; 0: no confirmation).")
    tune.add_argument("--confirm-runs", type=int, default=2, metavar="R",
                      help="Re-runs of each of them; the best median wins (default 2).")
    tune.add_argument("--seed", type=int, default=0, help="Seeds the initial sample, exploration and the proxy.")
    tune.add_argument("--per-round", type=int, default=3, metavar="K",
                      help="Trials per round after the initial design: K-1 the proxy ranks best, 1 to explore "
                      "(default 3; --sampler tpe or random: 1 per round).")
    tune.add_argument("--trial-timeout", type=float, default=1800.0, metavar="SECONDS",
                      help="A trial running longer is stopped and counts as failed (default 1800).")


def run(args: argparse.Namespace, script_args: list[str]) -> int:
    from lightning_ett.tune.samplers import make_sampler
    from lightning_ett.tune.search import search  # scikit-learn and SciPy: only for this command

    console = Console()
    try:
        plan = prepare(args, script_args)
    except (TuneError, SpaceError, PermissionError) as err:
        print(f"lightning-ett tune: {err}", file=sys.stderr)
        return 2
    space, runner, log, header = plan
    objective = partial(_objective, objective=args.objective, job_hours=args.job_hours, mtbf_hours=args.mtbf_hours)
    sampler = make_sampler(args.sampler, space, args.budget, args.seed, log_target=True)
    first = {"proxy": f"sampler proxy, {space.initial_size(args.budget)} trials of initial design",
             "tpe": f"sampler tpe, {space.initial_size(args.budget)} random start-up trials"}.get(args.sampler,
                                                                                                f"sampler {args.sampler}")
    confirm = f" + {args.confirm_top} x {args.confirm_runs} confirmation runs" if args.confirm_top else ""
    console.print(f"lightning-ett tune: {space.size} configurations, budget {args.budget}{confirm} "
                  f"({len(log.trials)} done already), {first}, {args.steps} steps per trial")
    if args.objective == "ett":
        console.print(f"objective ett: samples per hour of a {args.job_hours:g} h job failing every "
                      f"{args.mtbf_hours:.3g} h ({args.mtbf_source})")

    def on_trial(t: Trial) -> None:
        shown = f"{args.objective} {t.objective:.4g}" if t.objective is not None else f"[red]failed[/red]: {t.reason}"
        predicted = f" (proxy predicted {t.predicted:.4g})" if t.predicted is not None else ""
        what = f"confirmation run {t.repeat}" if t.repeat else f"round {t.round}"
        console.print(f"trial {t.index} ({what}, {t.seconds:.0f} s): {t.config} → {shown}{predicted}")

    def on_round(r: RoundReport) -> None:
        rho = f"{r.cv_spearman:.2f}" if r.cv_spearman is not None else "n/a (< 5 configurations, or constant)"
        best = f"{r.best:.4g}" if r.best is not None else "none yet"
        console.print(f"[bold]round {r.round}[/bold]: {r.trials} trials, best median {args.objective} {best}; proxy "
                      f"leave-one-out Spearman {rho} (on {r.configurations} configurations)")

    per_round = args.per_round if args.sampler == "proxy" else 1
    try:
        with _interruptible(runner) as evaluate:
            rounds = search(space, evaluate, objective, log, args.budget, sampler, per_round=per_round, seed=args.seed,
                            confirm_top=args.confirm_top, confirm_runs=args.confirm_runs, header=header,
                            on_trial=on_trial, on_round=on_round)
    except KeyboardInterrupt:
        console.print(f"[yellow]lightning-ett tune: interrupted; the {len(log.trials)} finished trials are kept in "
                      f"{log.path} (the interrupted one is not): run the same command again to continue.[/yellow]")
        return 130
    return finish(space, log, rounds, Path(args.out), args.objective, args.seed, args.confirm_runs, console)


def finish(space: Space, log: TrialLog, rounds: list[RoundReport], out: Path, objective: str, seed: int,
           confirm_runs: int, console: Console) -> int:
    import random

    from lightning_ett.tune.report import print_table, write_best, write_png, write_predictions
    from lightning_ett.tune.search import best, final_predictions

    untried = space.untried(random.Random(seed), {t.key for t in log.trials})
    tried, predicted = final_predictions(space, log, seed, True, untried)
    print_table(log, objective, tried, predicted, console)
    write_png(out, log, rounds, tried, objective)
    write_predictions(out, tried, predicted)
    winner = best(log, confirm_runs)
    if winner is None:
        console.print("[red]lightning-ett tune: no trial succeeded; see the failures above.[/red]")
        return 1
    path = write_best(out, winner, objective)
    spread = f" (runs {', '.join(f'{v:.4g}' for v in winner.values)})" if len(winner.values) > 1 else " (one run)"
    console.print(f"best: {winner.config} → median {objective} {winner.median:.4g}{spread}; {path} "
                  f"(pass it with --config after the script's own)")
    return 0


@contextlib.contextmanager
def _interruptible(runner: TrialRunner) -> Iterator[Callable[[int, dict[str, Any]], Any]]:
    """Ctrl-C ends the tune, not only the trial: the terminal's SIGINT reaches the trial's processes too, whose
    `lightning run` ends as "stopped by the user" — a trial that must not be recorded as the configuration's
    result. The tune notes the SIGINT, lets the trial end, and stops before recording it."""
    interrupted = False

    def note(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True

    def evaluate(index: int, config: dict[str, Any]) -> Any:
        if interrupted:
            raise KeyboardInterrupt
        result = runner(index, config)
        if interrupted:
            raise KeyboardInterrupt
        return result

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield evaluate
    finally:
        signal.signal(signal.SIGINT, previous)


def _objective(measurements: dict[str, Any], objective: str, job_hours: float | None,
               mtbf_hours: float | None) -> float | None:
    m = Measurement(**measurements)
    if objective == "ett" and m.ok and m.save_cost_s is None:
        raise ValueError("no checkpoint save was measured, which --objective ett needs: AsyncCheckpoint must save within "
                         "--steps steps with every_n_train_steps (or 'auto'); raise --steps or lower the interval")
    return score(m, objective, job_hours, mtbf_hours)


def prepare(args: argparse.Namespace, script_args: list[str]) -> tuple[Space, TrialRunner, TrialLog, dict[str, Any]]:
    """Every check that needs no trial; raises :class:`TuneError` (or SpaceError, PermissionError)."""
    for name, value, low in (("--budget", args.budget, 1), ("--steps", args.steps, 1), ("--devices", args.devices, 1),
                             ("--per-round", args.per_round, 1), ("--confirm-top", args.confirm_top, 0),
                             ("--confirm-runs", args.confirm_runs, 0)):
        if value < low:
            raise TuneError(f"{name} {value}: expected an integer >= {low}.")
    space = Space.load(args.space)
    for option, flag in CONTROLLED.items():
        if option in space.options:
            raise TuneError(f"--space: {option!r} is set by every trial from {flag} (it would override the space's "
                            f"value); remove it from the space and tune it with separate runs of {flag}.")
    if args.budget < space.min_budget:
        raise TuneError(f"--budget {args.budget} is smaller than the initial design ({space.min_budget} trials: every "
                        f"value of every option once); give --budget {space.min_budget} or more.")
    args.mtbf_source = "stated: --mtbf-hours"
    if args.objective == "ett":
        if args.mtbf_from is not None and args.mtbf_hours is not None:
            raise TuneError("--mtbf-hours and --mtbf-from both give the MTBF; give one.")
        if args.mtbf_from is not None:
            try:
                args.mtbf_hours, args.mtbf_source = mtbf_hours_from(args.mtbf_from)
            except FileNotFoundError as err:
                raise TuneError(f"--mtbf-from {args.mtbf_from!r}: no ETT ledger to read the MTBF from ({err}).") from err
            except ValueError as err:
                raise TuneError(f"--mtbf-from {args.mtbf_from!r}: {err}.") from err
        for name, value in (("--job-hours", args.job_hours), ("--mtbf-hours (or --mtbf-from)", args.mtbf_hours)):
            if value is None or not value > 0:
                raise TuneError(f"--objective ett needs {name} > 0 (got {value}).")
    script = Path(args.script).resolve()
    if not script.is_file():
        raise TuneError(f"SCRIPT {args.script!r} is not a file.")
    out = Path(args.out).resolve()
    error = writable_dir_error(out, "lightning-ett tune(--out")
    if error is not None:
        raise error
    script_args = absolute_paths(list(script_args), Path.cwd())
    if not script_args or script_args[0] not in SUBCOMMANDS:
        script_args = ["fit", *script_args]
    config = script_config(out, script, script_args)
    check_options(space, config, script)
    callbacks = (config.get("trainer") or {}).get("callbacks") or []
    classes = [c.get("class_path", "") if isinstance(c, dict) else str(c) for c in callbacks]
    if not any(c.endswith("ETTMonitor") for c in classes):
        script_args.append(f"--trainer.callbacks+={ETT_MONITOR}")
    if args.objective == "ett" and not any(c.endswith("AsyncCheckpoint") for c in classes) \
            and "AsyncCheckpoint" not in script.read_text(errors="replace"):  # (or added by the script itself)
        raise TuneError("--objective ett needs the script to checkpoint with lightning_ett.AsyncCheckpoint (its measured "
                        "save cost is one of the objective's terms); add it to the script's callbacks.")
    header = {"script": str(script), "script_args": script_args, "space": space.options, "objective": args.objective,
              "steps": args.steps, "devices": args.devices, "seed": args.seed, "job_hours": args.job_hours,
              "mtbf_hours": args.mtbf_hours, "sampler": args.sampler, "budget": args.budget, "format": 2}
    log = TrialLog(out)
    _check_same_tune(log, header)
    runner = TrialRunner(script, script_args, args.steps, args.devices, out, args.trial_timeout)
    return space, runner, log, header


def _check_same_tune(log: TrialLog, header: dict[str, Any]) -> None:
    if not log.trials:
        return
    import json

    before = json.loads(log.path.read_text())
    if before.get("format") != header["format"] and header["objective"] == "ett":
        raise TuneError(f"--out {str(log.path.parent)!r} holds an --objective ett tune of an older version, whose "
                        "values meant ETT%, not samples per hour; give another --out.")
    keys = ("script", "script_args", "space", "objective", "steps", "devices", "seed", "sampler", "job_hours",
            "mtbf_hours")
    differs = [k for k in keys if before.get(k, "proxy" if k == "sampler" else None) != header[k]]  # (older: proxy)
    if differs:
        raise TuneError(f"--out {str(log.path.parent)!r} holds a tune with another {', '.join(differs)}; continue it with "
                        "the same settings (an MTBF read with --mtbf-from must not have changed), or give another --out.")


def script_config(out: Path, script: Path, script_args: list[str]) -> dict[str, Any]:
    """The script's configuration, printed once per tune: ``DIR/script_config.yaml`` serves a resumed one."""
    cached = out / SCRIPT_CONFIG_FILE
    if cached.exists():
        saved = yaml.safe_load(cached.read_text()) or {}
        if saved.get("script") == str(script) and saved.get("script_args") == script_args:
            return saved["config"]
    config = print_config(script, script_args)
    atomic_write_text(cached, yaml.safe_dump({"script": str(script), "script_args": script_args, "config": config}))
    return config


def print_config(script: Path, script_args: list[str]) -> dict[str, Any]:
    """The script's full LightningCLI configuration with these arguments (its own ``--print_config``)."""
    proc = subprocess.run([sys.executable, str(script), *script_args, "--print_config"], capture_output=True, text=True,
                          timeout=600, check=False)
    if proc.returncode != 0:
        raise TuneError(f"`{script.name} {' '.join(script_args)} --print_config` failed, so its options cannot be "
                        f"checked:\n{proc.stderr.strip()[-2000:]}")
    try:
        config = yaml.safe_load(proc.stdout)
    except yaml.YAMLError as err:
        raise TuneError(f"`{script.name} --print_config` printed no YAML ({err}); is it a LightningCLI script?") from err
    if not isinstance(config, dict):
        raise TuneError(f"`{script.name} --print_config` printed no configuration; is it a LightningCLI script?")
    return config


def option_names(config: Any, prefix: str = "") -> list[str]:
    names = []
    if isinstance(config, dict):
        for k, v in config.items():
            name = f"{prefix}{k}"
            names.append(name)
            names += option_names(v, name + ".")
    return names


def check_options(space: Space, config: dict[str, Any], script: Path) -> None:
    known = option_names(config)
    for option in space.options:
        if option not in known:
            close = difflib.get_close_matches(option, known, n=4, cutoff=0.6)
            hint = f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise TuneError(f"--space: {option!r} is not an option of {script.name}'s LightningCLI.{hint} (Its options "
                            f"are listed by `{script.name} fit --print_config`.)")
