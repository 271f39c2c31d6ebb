"""The performance proxy: a scikit-learn model from a configuration's features to its objective.

A Gaussian process with one length scale per feature (Matern 5/2 plus a noise term, on features
scaled to [0, 1]): it represents interactions, extrapolates a numeric knob's trend, and says how
unsure it is (the proxy sampler explores there). Chosen by ``benchmarks/tune_proxy_choice.py``
among depth-1 and depth-3 boosting, a random forest, extra trees, an isotropic GP and a
quadratic response surface: the most searches within 5 % of the best over the design grid and
three synthetic families with interactions (the held-out grid was not used). Trained on the
trials that succeeded (the objective in log space, where a knob's effect is a factor). Its
quality is reported as it would be judged on configurations it has not seen:
leave-one-out cross-validation, each trial predicted by a proxy fitted on the others, and the
Spearman rank correlation of those predictions with what was measured (a search needs the
order right, not the values).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np
from scipy.stats import spearmanr
from sklearn.ensemble import ExtraTreesRegressor, GradientBoostingRegressor, RandomForestRegressor
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import ConstantKernel, Matern, WhiteKernel
from sklearn.linear_model import BayesianRidge
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import MinMaxScaler, PolynomialFeatures

from lightning_ett.tune.space import Config, Space

#: The proxy models ``benchmarks/tune_proxy_choice.py`` compares; :data:`DEFAULT_KIND` is the one it chose.
#: (Why not Optuna's GP sampler: it is a sampler, not a model this report can query for predictions.)
KINDS = ("stumps", "boosted", "forest", "extra_trees", "gp", "gp_ard", "quadratic")
DEFAULT_KIND = "gp_ard"


def _model(kind: str, seed: int, n_features: int = 1) -> Any:
    if kind == "stumps":  # depth-1 boosting: additive in the options, cannot see an interaction
        return GradientBoostingRegressor(n_estimators=300, learning_rate=0.05, max_depth=1, random_state=seed)
    if kind == "boosted":
        return GradientBoostingRegressor(n_estimators=200, learning_rate=0.05, max_depth=3, random_state=seed)
    if kind == "forest":
        return RandomForestRegressor(n_estimators=200, min_samples_leaf=1, max_features=0.6, random_state=seed)
    if kind == "extra_trees":
        return ExtraTreesRegressor(n_estimators=200, min_samples_leaf=1, max_features=0.6, random_state=seed)
    if kind == "gp":
        kernel = ConstantKernel() * Matern(nu=2.5) + WhiteKernel(noise_level=1e-2)
        return make_pipeline(MinMaxScaler(), GaussianProcessRegressor(kernel, normalize_y=True, random_state=seed))
    if kind == "gp_ard":  # one length scale per feature: an option that matters little gets a long one
        kernel = ConstantKernel() * Matern(length_scale=np.ones(n_features), nu=2.5) + WhiteKernel(noise_level=1e-2)
        return make_pipeline(MinMaxScaler(), GaussianProcessRegressor(kernel, normalize_y=True, random_state=seed))
    if kind == "quadratic":  # a response surface: every main effect and every two-option interaction, shrunk
        return make_pipeline(MinMaxScaler(), PolynomialFeatures(2, interaction_only=True, include_bias=False),
                             BayesianRidge())
    raise ValueError(f"proxy kind {kind!r}: expected one of {', '.join(KINDS)}.")


def _fit(kind: str, seed: int, x: np.ndarray, y: np.ndarray) -> Any:
    from sklearn.exceptions import ConvergenceWarning

    with warnings.catch_warnings():  # a GP's hyperparameters at their bounds on a dozen points: expected, not news
        warnings.simplefilter("ignore", ConvergenceWarning)
        return _model(kind, seed, x.shape[1]).fit(x, y)


class Proxy:
    def __init__(self, space: Space, log_target: bool, seed: int = 0, kind: str = DEFAULT_KIND) -> None:
        self.space = space
        self.log_target = log_target
        self.seed = seed
        self.kind = kind
        self._model: Any = None

    def _x(self, configs: list[Config]) -> np.ndarray:
        return np.array([self.space.features(c) for c in configs], dtype=float)

    def _y(self, values: list[float]) -> np.ndarray:
        y = np.array(values, dtype=float)
        return np.log(y) if self.log_target else y

    def _back(self, y: np.ndarray) -> list[float]:
        return [float(v) for v in (np.exp(y) if self.log_target else y)]

    def fit(self, configs: list[Config], values: list[float]) -> Proxy:
        self._model = _fit(self.kind, self.seed, self._x(configs), self._y(values))
        return self

    def predict(self, configs: list[Config]) -> list[float]:
        assert self._model is not None, "fit the proxy first"
        return self._back(self._model.predict(self._x(configs)))

    def predict_with_spread(self, configs: list[Config]) -> tuple[list[float], list[float] | None]:
        """Predictions and how unsure the proxy is of each (the spread of a forest's trees, a GP's standard
        deviation; ``None`` for boosting, which has no such measure) — what exploration picks by."""
        assert self._model is not None, "fit the proxy first"
        x = self._x(configs)
        model = self._model
        if hasattr(model, "estimators_") and self.kind in ("forest", "extra_trees"):
            per_tree = np.stack([tree.predict(x) for tree in model.estimators_])
            return self._back(per_tree.mean(axis=0)), [float(v) for v in per_tree.std(axis=0)]
        if self.kind in ("gp", "gp_ard", "quadratic"):
            mean, std = model.predict(x, return_std=True)
            return self._back(mean), [float(v) for v in std]
        return self.predict(configs), None

    def cross_validated(self, configs: list[Config], values: list[float]) -> tuple[list[float], float | None]:
        """Leave-one-out predictions and their Spearman correlation with ``values`` (``None`` below 3 trials)."""
        if len(configs) < 3:
            return [], None
        x, y = self._x(configs), self._y(values)
        predicted = []
        for i in range(len(configs)):
            keep = np.arange(len(configs)) != i
            model = _fit(self.kind, self.seed, x[keep], y[keep])
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
