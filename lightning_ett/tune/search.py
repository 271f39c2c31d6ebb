"""The search: a space-filling first sample, then rounds in which the proxy picks what to run.

1. Run the initial design (:meth:`Space.initial_design`: every value of every option at least once).
2. Fit the proxy on the trials that succeeded; predict every untried configuration (a uniform
   sample of them in a big space).
3. Run the ``per_round - 1`` most promising and one more for exploration (a proxy fitted on
   a handful of points is confidently wrong about regions it has not seen): while some option
   value has no successful trial yet (its trial in the initial sample failed), the most
   promising untried configuration with such a value; otherwise one drawn at random.
4. Report the proxy's cross-validated rank correlation; refit; repeat until ``budget`` trials ran.

Trials already in the log (a resumed tune) count towards the budget and are not run again.
The evaluator is any ``(index, config) -> (failure reason | None, measurements, seconds, run dir)``:
:class:`~lightning_ett.tune.trials.TrialRunner` runs the script for real; the benchmark
replays a measured grid.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightning_ett.tune.proxy import Proxy
from lightning_ett.tune.space import Config, Space, key
from lightning_ett.tune.trials import Trial, TrialLog

Evaluator = Callable[[int, Config], tuple[str | None, dict[str, Any], float, str | None]]
Objective = Callable[[dict[str, Any]], float | None]


@dataclass(frozen=True)
class RoundReport:
    round: int
    trials: int  # run so far
    best: float | None
    best_config: Config | None
    cv_spearman: float | None  # the proxy's leave-one-out rank correlation on the trials so far


def ok_trials(log: TrialLog) -> list[Trial]:
    return [t for t in log.trials if t.outcome == "ok" and t.objective is not None]


def search(space: Space, evaluate: Evaluator, objective: Objective, log: TrialLog, budget: int, seed: int = 0,
           per_round: int = 3, log_target: bool = True, header: dict[str, Any] | None = None,
           on_trial: Callable[[Trial], None] | None = None,
           on_round: Callable[[RoundReport], None] | None = None) -> list[RoundReport]:
    done = log.done()
    reports: list[RoundReport] = []

    def run(config: Config, round_no: int, predicted: float | None) -> None:
        reason, measurements, seconds, run_dir = evaluate(len(log.trials), config)
        value = objective(measurements) if reason is None else None
        if reason is None and value is None:
            reason = "its objective could not be computed from what it measured"
        trial = Trial(len(log.trials), config, round_no, "ok" if reason is None else "failed", value, reason,
                      measurements, run_dir, seconds, predicted)
        log.add(trial, {**(header or {}), "rounds": [r.__dict__ for r in reports]})
        done[trial.key] = trial
        if on_trial is not None:
            on_trial(trial)

    def close_round(round_no: int) -> None:
        ok = ok_trials(log)
        best = max(ok, key=lambda t: t.objective, default=None)  # type: ignore[arg-type, return-value]
        rho = Proxy(space, log_target, seed).cross_validated([t.config for t in ok], [t.objective for t in ok])[1] \
            if len(ok) >= 3 else None
        report = RoundReport(round_no, len(log.trials), best.objective if best else None, best.config if best else None, rho)
        reports.append(report)
        if on_round is not None:
            on_round(report)

    for config in space.initial_design(random.Random(seed)):
        if len(done) >= budget:
            break
        if key(config) not in done:
            run(config, 0, None)
    close_round(0)
    round_no = max((t.round for t in log.trials), default=0) + 1
    while len(done) < budget:
        rng = random.Random(seed * 1_000_003 + round_no)
        untried = [c for c in space.candidates(rng) if key(c) not in done]
        if not untried:
            break
        picks = _picks(space, untried, ok_trials(log), per_round, rng, seed, log_target)
        for config, predicted in picks:
            if len(done) >= budget:
                break
            run(config, round_no, predicted)
        close_round(round_no)
        round_no += 1
    return reports


def _picks(space: Space, untried: list[Config], ok: list[Trial], per_round: int, rng: random.Random, seed: int,
           log_target: bool) -> list[tuple[Config, float | None]]:
    if len(ok) < 2:  # nothing to learn from yet: explore
        return [(c, None) for c in rng.sample(untried, min(per_round, len(untried)))]
    proxy = Proxy(space, log_target, seed).fit([t.config for t in ok], [t.objective for t in ok])  # type: ignore[misc]
    predicted = proxy.predict(untried)
    order = sorted(range(len(untried)), key=lambda i: -predicted[i])
    chosen = order[: max(per_round - 1, 1)]
    rest = order[len(chosen):]
    if rest and per_round > 1:
        unseen = _uncovered(space, [t.config for t in ok] + [untried[i] for i in chosen])
        filling = [i for i in rest if any(key({name: untried[i][name]}) in unseen for name in space.options)]
        chosen.append(filling[0] if filling else rng.choice(rest))  # the best-predicted one that fills a gap
    return [(untried[i], predicted[i]) for i in chosen]


def _uncovered(space: Space, configs: list[Config]) -> set[str]:
    """The option values (as ``key({option: value})``, so ``True`` is not ``1``) that no successful trial (nor
    pick) has: a failed trial in the initial sample leaves its values unseen, and the proxy cannot extrapolate to a
    value it never saw (a stump splits between seen ones)."""
    every = {key({name: v}) for name, values in space.options.items() for v in values}
    return every - {key({name: c[name]}) for c in configs for name in space.options}


def final_predictions(space: Space, log: TrialLog, seed: int = 0, log_target: bool = True,
                      candidates: list[Config] | None = None) -> tuple[dict[str, float], dict[str, float]]:
    """The final proxy's predictions: leave-one-out for the trials that ran, a fit on all of them for ``candidates``."""
    ok = ok_trials(log)
    if len(ok) < 2:
        return {}, {}
    proxy = Proxy(space, log_target, seed)
    loo, _ = proxy.cross_validated([t.config for t in ok], [t.objective for t in ok])  # type: ignore[misc]
    tried = {t.key: p for t, p in zip(ok, loo)} if loo else {}
    untried: dict[str, float] = {}
    if candidates:
        proxy.fit([t.config for t in ok], [t.objective for t in ok])  # type: ignore[misc]
        untried = {key(c): p for c, p in zip(candidates, proxy.predict(candidates))}
    return tried, untried
