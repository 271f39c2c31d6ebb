"""Which proxy model `tune` ships: each candidate's search, replayed on the design grid and on synthetic spaces.

    .venv/bin/python benchmarks/tune_proxy_choice.py [--seeds 20] [--functions 10]

Candidates: :data:`lightning_ett.tune.proxy.KINDS` (depth-1 boosting — the old proxy —, deeper
boosting, a random forest, extra trees, a Gaussian process). Each runs ``tune``'s search
(``benchmarks/tune.py``'s ``proxy`` arm, confirmation included) on

* the **design grid** (``dlrm``, the measured 48), one search per seed;
* **synthetic spaces with an interaction and noise**: 4 x 3 x 2 x 2 x 2 = 96 configurations,
  log-throughput = a random effect per option value + a random effect per combination of two
  options' values (the interaction) + 3 % measurement noise (two stored runs per
  configuration, replayed like a grid's). ``--functions`` such spaces, 3 seeds each.
* **sign-flip spaces**: the same, but the interaction is one that main effects cannot show —
  one value of an option is the best with one value of another and the worst with the other
  (+-0.6 in log-throughput), so on average it looks like the rest.
* **the hidden interaction** of ``tests/test_tune_search.py`` (48 configurations, 3 % noise),
  12 seeds: the best configuration's two values are each the worse choice on average, so a model
  additive in the options predicts its best elsewhere.

Scored by how often the chosen configuration is within 5 % of the best, and its mean regret.
``--ranking``: instead, how well each model, fitted on a random quarter of a space (one noisy run
each), ranks the other three quarters by their true value (median Spearman; 20 draws on the
design grid and the hidden interaction, 5 per synthetic space).

The held-out grid (``user``) is not used here: the choice is made without it.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from tune import Replay, load, run_arm

from lightning_ett.tune.proxy import KINDS, Proxy, spearman
from lightning_ett.tune.space import Space, key

SYNTHETIC = {"a": [1, 2, 4, 8], "b": ["x", "y", "z"], "c": [True, False], "d": [16, 64], "e": ["p", "q"]}


def synthetic(seed: int, noise: float = 0.03, interaction: float = 0.35, sign_flip: bool = False) -> Replay:
    """A space whose log-throughput has main effects, one two-option interaction and multiplicative noise."""
    rng = np.random.default_rng(seed)
    space = Space.from_mapping(SYNTHETIC)
    names = list(SYNTHETIC)
    main = {(n, i): rng.normal(0, 0.25) for n in names for i in range(len(SYNTHETIC[n]))}
    first, second = rng.choice(len(names), size=2, replace=False)
    pair = (names[first], names[second])
    table = {(i, j): rng.normal(0, interaction) for i in range(len(SYNTHETIC[pair[0]]))
             for j in range(len(SYNTHETIC[pair[1]]))}
    if sign_flip:  # value 0 of the first option: +0.6 with value 0 of the second, -0.6 with value 1, else nothing
        table = {(i, j): (0.6 if j == 0 else -0.6 if j == 1 else 0.0) if i == 0 else 0.0 for (i, j) in table}
    runs, configs = {}, {}
    for config in space.configurations():
        idx = {n: SYNTHETIC[n].index(config[n]) for n in names}
        log_y = 10 + sum(main[(n, idx[n])] for n in names) + table[(idx[pair[0]], idx[pair[1]])]
        runs[key(config)] = [math.exp(log_y + rng.normal(0, noise)) for _ in range(2)]
        configs[key(config)] = config
    return Replay(space, runs, configs)  # type: ignore[arg-type]


def hidden() -> Replay:
    """The test suite's hidden interaction, two noisy runs per configuration."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    from test_tune_search import INTERACTING, interacting_value

    space = Space.from_mapping(INTERACTING)
    rng = random.Random(0)
    runs = {key(c): [interacting_value(c, rng) for _ in range(2)] for c in space.configurations()}
    return Replay(space, runs, {key(c): c for c in space.configurations()})  # type: ignore[arg-type]


def ranking(families: dict[str, list[tuple[Replay, int]]], kinds: list[str]) -> None:
    print("| proxy | " + " | ".join(f"{name}: untried Spearman" for name in families) + " |")
    print("|---|" + "---|" * len(families))
    for kind in kinds:
        cells = []
        for cases in families.values():
            replays = list({id(r): r for r, _ in cases}.values())
            rhos = []
            for replay in replays:
                keys = list(replay.truth)
                for seed in range(5 if len(replays) > 1 else 20):
                    rng = random.Random(seed)
                    fitted = rng.sample(keys, len(keys) // 4)
                    rest = [k for k in keys if k not in fitted]
                    proxy = Proxy(replay.space, True, seed, kind)
                    proxy.fit([replay.configs[k] for k in fitted], [rng.choice(replay.runs[k]) for k in fitted])
                    rho = spearman(proxy.predict([replay.configs[k] for k in rest]), [replay.truth[k] for k in rest])
                    rhos.append(rho or 0.0)
            cells.append(f"{statistics.median(rhos):.3f}")
        print(f"| {kind} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--functions", type=int, default=10)
    parser.add_argument("--kinds", nargs="*", default=list(KINDS))
    parser.add_argument("--references", nargs="*", default=["tpe_defaults", "tpe", "random"])
    parser.add_argument("--families", nargs="+", default=["design", "synthetic", "sign-flip", "hidden"])
    parser.add_argument("--ranking", action="store_true", help="the proxies' untried rank correlation instead")
    args = parser.parse_args()
    dlrm = load("dlrm", "throughput")
    assert dlrm is not None
    families = {"design grid (dlrm)": [(dlrm, seed) for seed in range(args.seeds)],
                "synthetic": [(synthetic(f), s) for f in range(args.functions) for s in range(3)],
                "sign-flip": [(synthetic(100 + f, sign_flip=True), s) for f in range(args.functions) for s in range(3)],
                "hidden": [(hidden(), s) for s in range(12)]}
    families = {name: cases for name, cases in families.items() if name.split()[0] in args.families}
    if args.ranking:
        ranking(families, args.kinds)
        return
    print("| proxy | " + " | ".join(f"{name}: within 5 % | {name}: mean regret" for name in families) + " |")
    print("|---|" + "---|---|" * len(families))
    arms = [("proxy", kind) for kind in args.kinds] + [(arm, None) for arm in args.references]
    for arm, kind in arms:
        cells = []
        for cases in families.values():
            regrets = [run_arm(replay, arm, seed, replay.space.size // 4, kind) for replay, seed in cases]
            cells += [f"{sum(r <= 0.05 for r in regrets)} of {len(regrets)}", f"{statistics.mean(regrets):.3f}"]
        print(f"| {kind or f'({arm})'} | " + " | ".join(cells) + " |", flush=True)

if __name__ == "__main__":
    main()
