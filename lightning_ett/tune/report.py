"""What a tune leaves behind besides trials.json: ``best.yaml``, ``tune_report.png`` and the printed table."""

from __future__ import annotations

from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from lightning_ett.durable.files import atomic_write_text
from lightning_ett.tune.search import Measured, RoundReport, measured, ok_trials
from lightning_ett.tune.space import config_fragment, key
from lightning_ett.tune.trials import TrialLog

BEST_FILE = "best.yaml"
REPORT_PNG = "tune_report.png"
PREDICTIONS_FILE = "predictions.json"


def write_best(out: Path, best: Measured, objective: str) -> Path:
    """The best configuration as a LightningCLI config fragment (``SCRIPT fit --config … --config best.yaml``),
    headed by its median and the spread of its runs."""
    values = sorted(best.values)
    spread = (f"{len(values)} runs: min {values[0]:.6g}, max {values[-1]:.6g} "
              f"({(values[-1] - values[0]) / best.median:+.1%} of the median)" if len(values) > 1  # type: ignore[operator]
              else "1 run (no confirmation)")
    failed = f"; {best.failures} failed run(s)" if best.failures else ""
    text = (f"# lightning-ett tune: best median {objective} {best.median:.6g}, {spread}{failed}\n"
            + yaml.safe_dump(config_fragment(best.config), sort_keys=False))
    return atomic_write_text(out / BEST_FILE, text)


def write_predictions(out: Path, tried: dict[str, float], untried: dict[str, float]) -> Path:
    """The final proxy's word on every configuration: left out of its fit for those that ran, predicted for the rest."""
    import json

    payload = {"tried_left_out": tried, "untried": dict(sorted(untried.items(), key=lambda kv: -kv[1]))}
    return atomic_write_text(out / PREDICTIONS_FILE, json.dumps(payload, indent=1) + "\n")


def print_table(log: TrialLog, objective: str, tried: dict[str, float], untried: dict[str, float], console: Console,
                top: int = 8) -> None:
    every = measured(log)
    ok = sorted((m for m in every.values() if m.values), key=lambda m: -m.median)  # type: ignore[operator]
    table = Table(title=f"Top configurations by median measured {objective} ({len(ok)} of {len(every)} configurations "
                        f"succeeded, {len(log.trials)} trials)")
    options = list(ok[0].config) if ok else []
    short = [o.rsplit(".", 1)[-1] for o in options]
    for option, name in zip(options, short):  # the last part of the dotted name, unless two options share it
        table.add_column(name if short.count(name) == 1 else option, overflow="fold")
    table.add_column(f"median {objective}")
    table.add_column("runs (min–max)")
    table.add_column("proxy (left out)")
    for m in ok[:top]:
        predicted = tried.get(key(m.config))
        runs = f"{m.runs}" + (f" ({min(m.values):.4g}–{max(m.values):.4g})" if len(m.values) > 1 else "")
        table.add_row(*(str(m.config[o]) for o in options), f"{m.median:.4g}", runs,
                      f"{predicted:.4g}" if predicted is not None else "—")
    console.print(table)
    best_untried = sorted(untried.items(), key=lambda kv: -kv[1])[:3]
    if best_untried:
        console.print("Best predicted among the configurations not run: "
                      + "; ".join(f"{k} → {v:.4g}" for k, v in best_untried))
    failed = [t for t in log.trials if t.outcome != "ok"]
    for t in failed:
        console.print(f"[red]trial {t.index} failed[/red]: {t.reason}  {key(t.config)}")


def write_png(out: Path, log: TrialLog, rounds: list[RoundReport], tried: dict[str, float], objective: str) -> Path:
    """Predicted (left out) vs measured; and every trial's objective by round with the best so far."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = ok_trials(log)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    pairs = [(tried[k], m.median) for k, m in measured(log).items() if k in tried and m.values]
    if pairs:
        x, y = zip(*pairs)
        left.scatter(y, x, s=22)
        low, high = min(x + y), max(x + y)
        left.plot([low, high], [low, high], color="grey", lw=1, ls="--")
    rho = rounds[-1].cv_spearman if rounds else None
    left.set(title=f"proxy, leave-one-out (Spearman {rho:.2f})" if rho is not None else "proxy, leave-one-out",
             xlabel=f"measured {objective} (median of its runs)", ylabel=f"predicted {objective}")
    right.scatter([t.round for t in ok], [t.objective for t in ok], s=22, label="trial")
    best, so_far = [], float("-inf")
    for r in sorted({t.round for t in ok}):
        so_far = max([so_far] + [t.objective for t in ok if t.round == r])  # type: ignore[list-item]
        best.append((r, so_far))
    if best:
        right.step(*zip(*best), where="post", color="C1", label="best so far")
    failed = [t.round for t in log.trials if t.outcome != "ok"]
    if failed:
        right.scatter(failed, [min(t.objective for t in ok)] * len(failed) if ok else [0] * len(failed), marker="x",
                      color="red", label="failed")
    right.set(title="objective per round (0: the initial sample)", xlabel="round", ylabel=objective)
    right.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    right.legend(loc="lower right")
    fig.tight_layout()
    path = out / REPORT_PNG
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
