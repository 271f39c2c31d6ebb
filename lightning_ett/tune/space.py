"""A search space of LightningCLI options: every configuration, the first sample, features, CLI arguments, YAML.

``SPACE.yaml`` maps LightningCLI option names (dotted, as on the command line) to the values to
try, e.g. ``data.batch_size: [256, 512, 1024]``. A configuration is one value per option.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

Config = dict[str, Any]
#: Above this many configurations, the proxy ranks a uniform sample of this many untried ones.
MAX_CANDIDATES = 20_000


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
            if not isinstance(values, list) or not values:
                raise SpaceError(f"{where}: option {name!r} has {'an empty list' if values == [] else repr(values)}; "
                                 "give it a non-empty list of values to try.")
            if len({_key(v) for v in values}) != len(values):
                raise SpaceError(f"{where}: option {name!r} lists a value twice: {values}.")
            options[name] = values
        return cls(options)

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.options.values())

    @property
    def initial_size(self) -> int:
        """The first, space-filling sample: every value of every option at least once (the longest list's length)."""
        return min(max(2, max(len(v) for v in self.options.values())), self.size)

    def configurations(self) -> Iterator[Config]:
        names = list(self.options)
        for values in itertools.product(*(self.options[n] for n in names)):
            yield dict(zip(names, values))

    def candidates(self, rng: random.Random) -> list[Config]:
        """Every configuration, or a uniform sample of :data:`MAX_CANDIDATES` of them for a big space."""
        if self.size <= MAX_CANDIDATES:
            return list(self.configurations())
        names = list(self.options)
        return [{n: rng.choice(self.options[n]) for n in names} for _ in range(MAX_CANDIDATES)]

    def initial_design(self, rng: random.Random) -> list[Config]:
        """A Latin-style sample: each option's values in a shuffled order, cycled, so every value appears."""
        n = self.initial_size
        columns = {}
        for name, values in self.options.items():
            order = list(values)
            rng.shuffle(order)
            columns[name] = [order[i % len(order)] for i in range(n)]
        design, seen = [], set()
        for i in range(n):
            config = {name: columns[name][i] for name in self.options}
            while key(config) in seen:  # a collision (small spaces): the next unseen configuration instead
                config = next(c for c in self.configurations() if key(c) not in seen)
            seen.add(key(config))
            design.append(config)
        return design

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
