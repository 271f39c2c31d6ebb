"""The performance proxy: scikit-learn's gradient boosting from a configuration's features to its objective.

Trained on the trials that succeeded (throughput in log space, where a knob's effect is a
factor). Its quality is reported as it would be judged on configurations it has not seen:
leave-one-out cross-validation, each trial predicted by a proxy fitted on the others, and the
Spearman rank correlation of those predictions with what was measured (a search needs the
order right, not the values).
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import spearmanr
from sklearn.ensemble import GradientBoostingRegressor

from lightning_ett.tune.space import Config, Space


def _model(seed: int) -> GradientBoostingRegressor:
    # Stumps (depth 1): boosting them fits an additive model, one curve per knob in log-throughput, which is
    # what a handful of trials can support and what predicts configurations never run (combinations of
    # values that were). Deeper trees fitted the trials as well and ranked the untried worse (see the README).
    return GradientBoostingRegressor(n_estimators=300, learning_rate=0.05, max_depth=1, min_samples_leaf=1,
                                     subsample=1.0, random_state=seed)


class Proxy:
    def __init__(self, space: Space, log_target: bool, seed: int = 0) -> None:
        self.space = space
        self.log_target = log_target
        self.seed = seed
        self._model: GradientBoostingRegressor | None = None

    def _x(self, configs: list[Config]) -> np.ndarray:
        return np.array([self.space.features(c) for c in configs], dtype=float)

    def _y(self, values: list[float]) -> np.ndarray:
        y = np.array(values, dtype=float)
        return np.log(y) if self.log_target else y

    def fit(self, configs: list[Config], values: list[float]) -> Proxy:
        self._model = _model(self.seed).fit(self._x(configs), self._y(values))
        return self

    def predict(self, configs: list[Config]) -> list[float]:
        assert self._model is not None, "fit the proxy first"
        y = self._model.predict(self._x(configs))
        return [float(v) for v in (np.exp(y) if self.log_target else y)]

    def cross_validated(self, configs: list[Config], values: list[float]) -> tuple[list[float], float | None]:
        """Leave-one-out predictions and their Spearman correlation with ``values`` (``None`` below 3 trials)."""
        if len(configs) < 3:
            return [], None
        x, y = self._x(configs), self._y(values)
        predicted = []
        for i in range(len(configs)):
            keep = np.arange(len(configs)) != i
            model = _model(self.seed).fit(x[keep], y[keep])
            predicted.append(float(model.predict(x[i : i + 1])[0]))
        rho = spearman(predicted, list(y))
        back = [float(math.exp(p)) if self.log_target else p for p in predicted]
        return back, rho


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (``None`` when either side is constant)."""
    if len(a) < 2 or len(set(a)) < 2 or len(set(b)) < 2:
        return None
    rho = spearmanr(a, b).statistic
    return float(rho) if math.isfinite(rho) else None
