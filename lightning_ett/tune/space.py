"""A search space of LightningCLI options: every configuration, the first sample, features, CLI arguments, YAML.

``SPACE.yaml`` maps LightningCLI option names (dotted, as on the command line) to the values to
try, e.g. ``data.batch_size: [256, 512, 1024]``. A configuration is one value per option.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Config = dict[str, Any]
#: Above this many configurations, the proxy ranks a uniform sample of this many untried ones.
MAX_CANDIDATES = 20_000
#: The initial design's coordinate exchange stops improving after this long (many options with many values).
DESIGN_SECONDS = 5.0


class SpaceError(ValueError):
    """A search space that cannot be searched, with what to fix."""


@dataclass(frozen=True)
class Space:
    options: dict[str, list[Any]]

    @classmethod
    def load(cls, path: str | Path) -> Space:
        try:
            raw = yaml.safe_load(Path(path).read_text())
        except OSError as err:
            raise SpaceError(f"--space {str(path)!r}: cannot read it ({err.strerror or err}).") from err
        except yaml.YAMLError as err:
            raise SpaceError(f"--space {str(path)!r} is not valid YAML: {err}") from err
        return cls.from_mapping(raw, f"--space {str(path)!r}")

    @classmethod
    def from_mapping(cls, raw: Any, where: str = "the space") -> Space:
        if not isinstance(raw, dict) or not raw:
            raise SpaceError(f"{where}: expected a mapping of LightningCLI option names to lists of values, e.g. "
                             "`data.batch_size: [256, 512]`.")
        options: dict[str, list[Any]] = {}
        for name, values in raw.items():
            if not isinstance(name, str) or not name or name.startswith("-"):
                raise SpaceError(f"{where}: option {name!r} is not a LightningCLI option name (write `data.batch_size`, "
                                 "not `--data.batch_size`).")
            if isinstance(values, dict):
                raise SpaceError(f"{where}: option {name!r} maps to a mapping; write nested options dotted, one per "
                                 f"line (e.g. `{name}.{next(iter(values), 'x')}: [...]`).")
            if not isinstance(values, list) or not values:
                raise SpaceError(f"{where}: option {name!r} has {'an empty list' if values == [] else repr(values)}"
                                 f"{'' if values == [] else ', not a list'}; give it a list of the values to try, "
                                 f"e.g. `{name}: [{'...' if values == [] else values}]`.")
            if len({_key(v) for v in values}) != len(values):
                raise SpaceError(f"{where}: option {name!r} lists a value twice: {values}.")
            options[name] = values
        return cls(options)

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.options.values())

    @property
    def min_budget(self) -> int:
        """The fewest trials that can show every value of every option once (the longest list's length)."""
        return min(max(2, max(len(v) for v in self.options.values())), self.size)

    @property
    def main_effect_parameters(self) -> int:
        """Parameters of a model with one effect per option value: 1 + sum(values - 1)."""
        return 1 + sum(len(v) - 1 for v in self.options.values())

    def initial_size(self, budget: int) -> int:
        """The initial design's size: enough to separate every option's effect (:attr:`main_effect_parameters`),
        but at most half the budget (the proxy needs trials of its own), and never fewer than :attr:`min_budget`."""
        return min(max(self.min_budget, min(self.main_effect_parameters, budget // 2)), self.size, budget)


    def configurations(self) -> Iterator[Config]:
        names = list(self.options)
        for values in itertools.product(*(self.options[n] for n in names)):
            yield dict(zip(names, values))

    def random_configuration(self, rng: random.Random) -> Config:
        return {n: rng.choice(values) for n, values in self.options.items()}

    def untried(self, rng: random.Random, exclude: set[str], limit: int = MAX_CANDIDATES) -> list[Config]:
        """Distinct configurations not in ``exclude`` (keys): all of them in a space of up to ``limit``, else a
        uniform sample of ``limit`` drawn without replacement, without enumerating the space."""
        if self.size <= limit:
            return [c for c in self.configurations() if key(c) not in exclude]
        found: dict[str, Config] = {}
        for _ in range(20 * limit):  # a space this big is almost never mostly tried: rejections are rare
            config = self.random_configuration(rng)
            k = key(config)
            if k not in exclude and k not in found:
                found[k] = config
                if len(found) == limit:
                    break
        return list(found.values())

    def initial_design(self, rng: random.Random, n: int, fixed: list[Config] | None = None) -> list[Config]:
        """``n`` distinct configurations in which the options vary independently of one another; with ``fixed``
        (configurations already run: a resumed tune), only the rest of the ``n`` are chosen, around them.

        A D-optimal design for a main-effects model, built by coordinate exchange (Meyer &
        Nachtsheim, 1995) from a balanced random start: each option's values are shuffled and
        cycled, then every (run, option) cell takes the value that most raises
        ``log det(X'X)`` of the effects-coded design, as long as every value of every option
        still appears (the proxy cannot place a value it never saw). Options then rarely change together, so
        the first fit can tell their effects apart; the "all options at once" Latin start alone
        confounds them. (scipy.stats.qmc's designs are for continuous factors, and pyDOE's
        fractional factorials need 2-level options: hand-written for mixed-level lists.)
        """
        import numpy as np

        names = list(self.options)
        kept = [[self._level(name, c[name]) for name in names] for c in (fixed or [])][:n]
        columns = {}
        for name in names:
            order = list(range(len(self.options[name])))
            rng.shuffle(order)
            columns[name] = [order[i % len(order)] for i in range(n)]
        design = kept + [[columns[name][i] for name in names] for i in range(len(kept), n)]

        def score(rows: list[list[int]]) -> tuple[int, float]:
            """(values of options covered, log det X'X): coverage first, then the D-criterion; duplicates lose."""
            if len({tuple(r) for r in rows}) < len(rows):
                return -1, float("-inf")
            covered = sum(len({r[j] for r in rows}) for j in range(len(names)))
            x = np.array([self._effects_row(r) for r in rows])
            return covered, float(np.linalg.slogdet(x.T @ x + 1e-6 * np.eye(x.shape[1]))[1])

        def distinct(rows: list[list[int]]) -> bool:
            return len({tuple(r) for r in rows}) == len(rows)

        current = score(design)
        deadline = time.monotonic() + DESIGN_SECONDS
        for _ in range(10):
            improved = False
            for i in range(len(kept), n):
                if time.monotonic() > deadline:  # a big space: the design so far is valid, only less optimal
                    break
                for j, name in enumerate(names):
                    for level in range(len(self.options[name])):
                        if level == design[i][j]:
                            continue
                        trial = [list(r) for r in design]
                        trial[i][j] = level
                        value = score(trial)
                        if value[0] > current[0] or (value[0] == current[0] and value[1] > current[1] + 1e-9):
                            design, current, improved = trial, value, True
            if not improved:
                break
        if not distinct(design):  # rows the exchange could not tell apart (a tiny space, or out of time)
            seen: set[tuple[int, ...]] = set()
            for i, row in enumerate(design):
                while tuple(design[i]) in seen:
                    design[i] = [rng.randrange(len(self.options[name])) for name in names]
                seen.add(tuple(design[i]))
        return [{name: self.options[name][row[j]] for j, name in enumerate(names)} for row in design[len(kept):]]

    def _level(self, name: str, value: Any) -> int:
        return next(i for i, v in enumerate(self.options[name]) if _key(v) == _key(value))

    def _effects_row(self, levels: list[int]) -> list[float]:
        """Effects coding: an intercept, then per option ``len - 1`` columns (the last value is all -1)."""
        row = [1.0]
        for level, values in zip(levels, self.options.values()):
            k = len(values) - 1
            row += [-1.0] * k if level == k else [1.0 if j == level else 0.0 for j in range(k)]
        return row

    # ------------------------------------------------------------------ what the proxy sees
    def feature_names(self) -> list[str]:
        names = []
        for option, values in self.options.items():
            kind = _kind(values)
            names += [option] if kind != "categorical" else [f"{option}={_key(v)}" for v in values]
        return names

    def features(self, config: Config) -> list[float]:
        """Numbers (log2 for positive ones spanning 4x or more), booleans as 0/1, anything else one-hot."""
        row: list[float] = []
        for option, values in self.options.items():
            value, kind = config[option], _kind(values)
            if kind == "log":
                row.append(math.log2(value))
            elif kind in ("number", "bool"):
                row.append(float(value))
            else:
                row += [1.0 if _key(value) == _key(v) else 0.0 for v in values]
        return row


def key(config: Config) -> str:
    """A configuration's identity (order-independent), for trials.json and de-duplication."""
    return json.dumps({k: config[k] for k in sorted(config)}, sort_keys=True, default=str)


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _kind(values: list[Any]) -> str:
    if all(isinstance(v, bool) for v in values):
        return "bool"
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        positive = all(v > 0 for v in values)
        return "log" if positive and max(values) >= 4 * min(values) else "number"
    return "categorical"


def cli_arguments(config: Config) -> list[str]:
    """``--option value`` pairs as LightningCLI reads them (YAML values: ``true``, ``null``, ``[1, 2]``)."""
    args = []
    for option, value in config.items():
        text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
        text = text.removesuffix("\n...").strip()
        args += [f"--{option}", text]
    return args


def config_fragment(config: Config) -> dict[str, Any]:
    """The configuration as a nested LightningCLI config (``data.batch_size`` → ``data: {batch_size: …}``)."""
    root: dict[str, Any] = {}
    for option, value in config.items():
        node = root
        *parents, leaf = option.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return root
