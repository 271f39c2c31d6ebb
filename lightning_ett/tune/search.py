"""The search: a sampler picks configurations until the budget is spent, then the best few are confirmed.

1. **Search.** The sampler (:mod:`lightning_ett.tune.samplers`: the proxy by default, Optuna's
   TPE, or random) proposes configurations not yet run, a round at a time; each runs once.
   ``budget`` counts distinct configurations; no configuration runs twice in this phase.
2. **Confirmation.** A single run is one draw of a noisy measurement, so the maximum of many
   single runs favours the luckiest, not the fastest. The ``confirm_top`` configurations with the
   best median so far run ``confirm_runs`` more times each (every sampler gets the same), and
   the best is the one with the highest **median** among them; one that failed in any run is
   passed over while another succeeded every time.
3. After every round, the proxy's leave-one-out rank correlation on the trials so far (the
   report's measure of how far to trust its predictions).

Trials already in the log (a resumed tune) count towards the budget and are not run again.
The evaluator is any ``(index, config) -> (failure reason | None, measurements, seconds, run dir)``:
:class:`~lightning_ett.tune.trials.TrialRunner` runs the script for real; the benchmark
replays a measured grid.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_ett.tune.proxy import Proxy
from lightning_ett.tune.samplers import Sampler
from lightning_ett.tune.space import Config, Space, key
from lightning_ett.tune.trials import Trial, TrialLog

Evaluator = Callable[[int, Config], tuple[str | None, dict[str, Any], float, str | None]]
#: A trial's value from its measurements; ``None`` or a ``ValueError`` (whose message becomes the trial's reason)
#: when it cannot be computed.
Objective = Callable[[dict[str, Any]], float | None]
#: The leave-one-out report refits the proxy once per configuration: after a round that added fewer than this many
#: configurations, the previous figure is carried (a TPE tune's rounds are one trial each).
REPORT_EVERY = 3
MIN_FOR_SPEARMAN = 5  # below, a rank correlation of left-out predictions is mostly noise


@dataclass(frozen=True)
class RoundReport:
    round: int
    trials: int  # run so far
    best: float | None
    best_config: Config | None
    cv_spearman: float | None  # the proxy's leave-one-out rank correlation on the trials so far
    configurations: int = 0  # how many configurations cv_spearman was computed on


@dataclass(frozen=True)
class Measured:
    """Every run of one configuration."""

    config: Config
    values: list[float]  # the objective of each successful run
    failures: int

    @property
    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None

    @property
    def runs(self) -> int:
        return len(self.values) + self.failures


def ok_trials(log: TrialLog) -> list[Trial]:
    return [t for t in log.trials if t.outcome == "ok" and t.objective is not None]


def measured(log: TrialLog) -> dict[str, Measured]:
    """Every configuration run so far, with all of its runs (search and confirmation)."""
    out: dict[str, Measured] = {}
    for t in log.trials:
        m = out.get(t.key) or Measured(t.config, [], 0)
        ok = t.outcome == "ok" and t.objective is not None
        out[t.key] = Measured(m.config, m.values + [t.objective] if ok else m.values,  # type: ignore[list-item]
                              m.failures + (not ok))
    return out


def results(log: TrialLog) -> dict[str, tuple[Config, float | None]]:
    """One value per configuration for samplers and the proxy: its median, or ``None`` when no run succeeded."""
    return {k: (m.config, m.median) for k, m in measured(log).items()}


def best(log: TrialLog, confirm_runs: int = 0) -> Measured | None:
    """The configuration with the highest median among the confirmed ones (run ``1 + confirm_runs`` times or more;
    every one when none was); one that ever failed only when every candidate did."""
    every = [m for m in measured(log).values() if m.values]
    if not every:
        return None
    confirmed = [m for m in every if m.runs >= 1 + confirm_runs] if confirm_runs else []
    pool = confirmed or every
    clean = [m for m in pool if not m.failures] or pool
    return max(clean, key=lambda m: m.median)  # type: ignore[arg-type, return-value]


def search(space: Space, evaluate: Evaluator, objective: Objective, log: TrialLog, budget: int, sampler: Sampler,
           per_round: int = 3, log_target: bool = True, seed: int = 0, confirm_top: int = 0, confirm_runs: int = 0,
           header: dict[str, Any] | None = None, on_trial: Callable[[Trial], None] | None = None,
           on_round: Callable[[RoundReport], None] | None = None, report_rounds: bool = True) -> list[RoundReport]:
    """Run the search and the confirmation; ``report_rounds=False`` skips the per-round leave-one-out report
    (a proxy fit per trial: the replayed benchmark's cost, not a real tune's)."""
    reports: list[RoundReport] = []

    def run(config: Config, round_no: int, predicted: float | None, repeat: int) -> Trial:
        reason, measurements, seconds, run_dir = evaluate(len(log.trials), config)
        value = None
        if reason is None:
            try:
                value = objective(measurements)
            except ValueError as err:
                reason = str(err)
        if reason is None and value is None:
            reason = "its objective could not be computed from what it measured"
        trial = Trial(len(log.trials), config, round_no, "ok" if reason is None else "failed", value, reason,
                      measurements, run_dir, seconds, predicted, repeat)
        log.add(trial, {**(header or {}), "rounds": [r.__dict__ for r in reports]})
        if on_trial is not None:
            on_trial(trial)
        return trial

    def close_round(round_no: int, final: bool = False) -> None:
        if not report_rounds:
            return
        fresh = len(measured(log)) - (reports[-1].configurations if reports else 0)
        if reports and fresh < REPORT_EVERY and not final:  # carry the last figure rather than refit n proxies
            last = reports[-1]
            report = round_report(space, log, round_no, log_target, seed, rho=(last.cv_spearman, last.configurations))
        else:
            report = round_report(space, log, round_no, log_target, seed)
        reports.append(report)
        if on_round is not None:
            on_round(report)

    round_no = max((t.round for t in log.trials), default=-1) + 1
    searched = {t.key for t in log.trials}
    while len(searched) < budget:
        picks = sampler.propose(min(per_round, budget - len(searched)), results(log), searched)
        picks = [(c, p) for c, p in picks if key(c) not in searched][: budget - len(searched)]
        if not picks:
            break  # every configuration ran
        for config, predicted in picks:
            trial = run(config, round_no, predicted, 0)
            searched.add(trial.key)
            sampler.observe(config, trial.objective)
        close_round(round_no)
        round_no += 1

    if confirm_top and confirm_runs:
        by_median = sorted((m for m in measured(log).values() if m.values), key=lambda m: -m.median)  # type: ignore[operator]
        ran = False
        for m in by_median[:confirm_top]:
            for repeat in range(m.runs, 1 + confirm_runs):
                run(m.config, round_no, None, repeat)
                ran = True
        if ran:
            close_round(round_no, final=True)
    if report_rounds and reports and reports[-1].configurations != len(measured(log)):  # the last figure, fresh
        reports[-1] = round_report(space, log, reports[-1].round, log_target, seed)
    return reports


def round_report(space: Space, log: TrialLog, round_no: int, log_target: bool, seed: int,
                 rho: tuple[float | None, int] | None = None) -> RoundReport:
    """The round's best median and the proxy's leave-one-out Spearman (``rho``: a figure carried from an earlier
    round, with the number of configurations it was computed on)."""
    every = measured(log)
    values = [(m.config, m.median) for m in every.values() if m.values]
    top = max(values, key=lambda cv: cv[1], default=None)  # type: ignore[arg-type, return-value]
    if rho is None:
        figure = Proxy(space, log_target, seed).cross_validated([c for c, _ in values], [v for _, v in values])[1] \
            if len(values) >= MIN_FOR_SPEARMAN else None
        rho = (figure, len(every))
    return RoundReport(round_no, len(log.trials), top[1] if top else None, top[0] if top else None, rho[0], rho[1])


def final_predictions(space: Space, log: TrialLog, seed: int = 0, log_target: bool = True,
                      candidates: list[Config] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """The final proxy's predictions: leave-one-out for the configurations that ran (their median), a fit on all
    of them for ``candidates``."""
    values = [(m.config, m.median) for m in measured(log).values() if m.values]
    if len(values) < 2:
        return {}, {}
    configs, ys = [c for c, _ in values], [v for _, v in values]
    proxy = Proxy(space, log_target, seed)
    loo, _ = proxy.cross_validated(configs, ys)  # type: ignore[arg-type]
    tried = {key(c): p for c, p in zip(configs, loo)} if loo else {}
    untried: dict[str, float] = {}
    if candidates:
        proxy.fit(configs, ys)  # type: ignore[arg-type]
        untried = {key(c): p for c, p in zip(candidates, proxy.predict(candidates))}
    return tried, untried
