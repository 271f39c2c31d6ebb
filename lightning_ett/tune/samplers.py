"""Who picks the next configurations: Optuna's TPE (the default), the proxy, or uniform random.

All three see the same history and answer the same question — "the next ``n`` configurations
not yet run" — so the search loop (:func:`lightning_ett.tune.search.search`), the trials, the
measurement and the final confirmation are the same whichever picks. ``benchmarks/tune.py``
compares them on that footing: on the held-out grid our proxy did not beat Optuna's TPE, so TPE
is the default (set for a small budget: ``multivariate=True``, and as many random start-up
trials as the proxy's initial design, instead of Optuna's 10). The proxy still reports how
predictable the space is (leave-one-out Spearman, predicted vs measured) whichever sampler runs.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Protocol

from lightning_ett.tune.space import Config, Space, key

if TYPE_CHECKING:
    import optuna

SAMPLERS = ("tpe", "proxy", "random")
DEFAULT_SAMPLER = "tpe"

Pick = tuple[Config, "float | None"]  # a configuration, and what the proxy predicted for it (None: not the proxy's)


class Sampler(Protocol):
    def propose(self, n: int, results: dict[str, tuple[Config, float | None]], exclude: set[str]) -> list[Pick]:
        """Up to ``n`` configurations whose keys are not in ``exclude``; ``results``: every configuration run so
        far (key → config, its objective or None when it failed)."""

    def observe(self, config: Config, value: float | None) -> None:
        """The result of a configuration this sampler proposed."""


class RandomSampler:
    def __init__(self, space: Space, seed: int = 0) -> None:
        self.space, self.rng = space, random.Random(seed)

    def propose(self, n: int, results: dict[str, tuple[Config, float | None]], exclude: set[str]) -> list[Pick]:
        untried = self.space.untried(self.rng, exclude, limit=max(4 * n, 64))
        return [(c, None) for c in self.rng.sample(untried, min(n, len(untried)))]

    def observe(self, config: Config, value: float | None) -> None:
        pass  # (uniform: the past does not change the next draw)


class ProxySampler:
    """A D-optimal initial design (:meth:`Space.initial_design`), then rounds ranked by the proxy.

    Each round runs the ``n - 1`` untried configurations the proxy predicts best and one for
    exploration: while some option value has no successful trial (its only trial failed), the
    most promising configuration with such a value, else the one the proxy is least sure of
    (its largest predictive standard deviation), else a random one. A value that failed in two
    configurations and never succeeded is not tried again. A proxy fitted on a
    handful of points is confidently wrong about regions it has not seen.
    """

    def __init__(self, space: Space, budget: int, seed: int = 0, log_target: bool = True,
                 kind: str | None = None) -> None:
        self.space, self.seed, self.log_target, self.kind = space, seed, log_target, kind
        self.design_size = space.initial_size(budget)
        self.design: list[Config] | None = None
        self.round = 0

    def propose(self, n: int, results: dict[str, tuple[Config, float | None]], exclude: set[str]) -> list[Pick]:
        if self.design is None:  # around what already ran (a resumed tune), so a longer budget extends a design
            self.design = self.space.initial_design(random.Random(self.seed), self.design_size,
                                                    fixed=[c for c, _ in results.values()])
        pending = [c for c in self.design if key(c) not in exclude]
        if pending:
            return [(c, None) for c in pending]  # the initial design, whole (it is one round)
        self.round += 1
        rng = random.Random(self.seed * 1_000_003 + self.round + len(results))
        untried = self.space.untried(rng, exclude)
        dead = _dead_values(self.space, results)
        untried = [c for c in untried if not any(key({o: c[o]}) in dead for o in self.space.options)] or untried
        ok = [(c, v) for c, v in results.values() if v is not None]
        if len(ok) < 2 or not untried:  # nothing to learn from yet: explore
            return [(c, None) for c in rng.sample(untried, min(n, len(untried)))]
        from lightning_ett.tune.proxy import DEFAULT_KIND, Proxy  # scikit-learn: only when a proxy runs

        proxy = Proxy(self.space, self.log_target, self.seed, self.kind or DEFAULT_KIND)
        proxy.fit([c for c, _ in ok], [v for _, v in ok])
        predicted, spread = proxy.predict_with_spread(untried)
        order = sorted(range(len(untried)), key=lambda i: -predicted[i])
        chosen = order[: max(n - 1, 1)]
        rest = order[len(chosen):]
        if rest and n > 1:
            unseen = _uncovered(self.space, [c for c, _ in ok] + [untried[i] for i in chosen])
            filling = [i for i in rest if any(key({o: untried[i][o]}) in unseen for o in self.space.options)]
            if filling:
                chosen.append(filling[0])
            elif spread is not None:
                chosen.append(max(rest, key=lambda i: spread[i]))
            else:
                chosen.append(rng.choice(rest))
        return [(untried[i], predicted[i]) for i in chosen]

    def observe(self, config: Config, value: float | None) -> None:
        pass  # (refitted on every result at the next proposal)


class TPESampler:
    """Optuna's TPE sampler (its defaults unless ``**kwargs`` say otherwise), asked and told through Optuna's
    ask-and-tell interface.

    A list of numbers is an ordered integer parameter over its values sorted (TPE can then use
    that 256 lies between 128 and 512, as the proxy's features do); anything else is a categorical
    of the values' indices (any YAML value can be one). A configuration TPE proposes again is told
    FAIL — which TPE leaves out of its densities and of its start-up count — and TPE is asked
    again, at most 20 times, then a random untried configuration runs: no run repeats, and
    duplicates do not count towards the budget.
    """

    def __init__(self, space: Space, seed: int = 0, **kwargs: Any) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)  # one INFO line per trial otherwise
        self.space, self.rng = space, random.Random(seed)
        self.study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed, **kwargs))
        self.told: set[str] = set()
        self.pending: dict[str, optuna.trial.Trial] = {}
        self.order = {name: _value_order(values) for name, values in space.options.items()}

    def _distributions(self) -> dict[str, Any]:
        import optuna

        return {name: optuna.distributions.IntDistribution(0, len(values) - 1) if self.order[name] is not None
                else optuna.distributions.CategoricalDistribution(list(range(len(values))))
                for name, values in self.space.options.items()}

    def _params(self, config: Config) -> dict[str, int]:
        params = {}
        for name, values in self.space.options.items():
            index = next(i for i, v in enumerate(values) if key({name: v}) == key({name: config[name]}))
            order = self.order[name]
            params[name] = order.index(index) if order is not None else index
        return params

    def _config(self, params: dict[str, int]) -> Config:
        return {name: values[self.order[name][params[name]] if self.order[name] is not None else params[name]]  # type: ignore[index]
                for name, values in self.space.options.items()}

    def _tell_history(self, results: dict[str, tuple[Config, float | None]]) -> None:
        """Results TPE did not propose (a resumed tune, a random fallback) become finished trials of the study."""
        import optuna

        for k, (config, value) in results.items():
            if k in self.told or k in self.pending:
                continue
            state = optuna.trial.TrialState.COMPLETE if value is not None else optuna.trial.TrialState.FAIL
            self.study.add_trial(optuna.trial.create_trial(params=self._params(config), distributions=self._distributions(),
                                                           value=value, state=state))
            self.told.add(k)

    def propose(self, n: int, results: dict[str, tuple[Config, float | None]], exclude: set[str]) -> list[Pick]:
        import optuna

        self._tell_history(results)
        distributions = self._distributions()
        picks: list[Pick] = []
        for _ in range(n):
            for _ in range(20):
                trial = self.study.ask(distributions)
                config = self._config(trial.params)
                k = key(config)
                if k in exclude or k in self.pending or any(key(c) == k for c, _ in picks):
                    self.study.tell(trial, state=optuna.trial.TrialState.FAIL)  # a repeat: not a result
                    continue
                self.pending[k] = trial
                picks.append((config, None))
                break
            else:
                taken = exclude | set(self.pending) | {key(c) for c, _ in picks}
                untried = self.space.untried(self.rng, taken, limit=64)
                if not untried:
                    break
                picks.append((self.rng.choice(untried), None))
        return picks

    def observe(self, config: Config, value: float | None) -> None:
        import optuna

        k = key(config)
        trial = self.pending.pop(k, None)
        if trial is None:
            return  # (a random fallback pick: told with the history at the next proposal)
        if value is None:
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        else:
            self.study.tell(trial, value)
        self.told.add(k)


def _value_order(values: list[Any]) -> list[int] | None:
    """For a list of numbers (not booleans), the indices of its values in increasing order; else ``None``."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sorted(range(len(values)), key=lambda i: values[i])
    return None


def make_sampler(name: str, space: Space, budget: int, seed: int = 0, log_target: bool = True,
                 **kwargs: Any) -> Sampler:
    if name == "proxy":
        return ProxySampler(space, budget, seed, log_target, **kwargs)
    if name == "tpe":  # what `lightning-ett tune` ships: TPE set for a budget of a few dozen trials
        return TPESampler(space, seed, **{"multivariate": True, "n_startup_trials": space.initial_size(budget), **kwargs})
    if name == "random":
        return RandomSampler(space, seed)
    raise ValueError(f"sampler {name!r}: expected one of {', '.join(SAMPLERS)}.")


def _dead_values(space: Space, results: dict[str, tuple[Config, float | None]]) -> set[str]:
    """Option values (as ``key({option: value})``) that failed in two or more configurations and never succeeded:
    no more budget goes to them (a value that crashes the script would otherwise be retried every round)."""
    failed: dict[str, int] = {}
    succeeded: set[str] = set()
    for config, value in results.values():
        for option in space.options:
            k = key({option: config[option]})
            if value is None:
                failed[k] = failed.get(k, 0) + 1
            else:
                succeeded.add(k)
    return {k for k, n in failed.items() if n >= 2 and k not in succeeded}


def _uncovered(space: Space, configs: list[Config]) -> set[str]:
    """The option values (as ``key({option: value})``, so ``True`` is not ``1``) that no successful trial (nor
    pick) has: a failed trial in the initial design leaves its values unseen, and the proxy cannot place a
    value it never saw."""
    every = {key({name: v}) for name, values in space.options.items() for v in values}
    return every - {key({name: c[name]}) for c in configs for name in space.options}
