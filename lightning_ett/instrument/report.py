"""Render a :class:`~lightning_ett.instrument.summary.Summary` for people: a rich table and a PNG.

The PNG shows what a table cannot: *when* each rank lost its time (a timeline lane per
rank, attempt boundaries marked) next to *how much* went to each phase.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lightning_ett.durable.files import atomic_write_bytes
from lightning_ett.instrument.cadence_facts import cadence_line
from lightning_ett.instrument.straggler_facts import straggler_line
from lightning_ett.instrument.summary import Summary
from lightning_ett.instrument.timeline import (
    CADENCE_FACT,
    FP8_FACT,
    LOST,
    PHASE_NAMES,
    PUBLISH_ERROR_FACT,
    PUBLISH_FACT,
    SPARSE_2D_FACT,
    Phase,
)

REPORT_PNG = "ett_report.png"

PHASE_COLORS: dict[str, str] = {
    Phase.LAUNCH.value: "#78909c",
    Phase.IMPORT.value: "#bdbdbd",
    Phase.TRAINER_INIT.value: "#a1887f",
    Phase.LIGHTNING_LAUNCHER.value: "#90a4ae",
    Phase.PROCESS_GROUP_INIT.value: "#8d6e63",
    Phase.LOGGER_INIT.value: "#f48fb1",
    Phase.MODEL_INIT.value: "#ffb74d",
    Phase.SHARDING_PLAN.value: "#ff8a65",
    Phase.DATA_INIT.value: "#fff176",
    Phase.COMPILE.value: "#ba68c8",
    Phase.CHECKPOINT_LOAD.value: "#4dd0e1",
    Phase.TRAIN.value: "#43a047",
    Phase.CHECKPOINT_SAVE.value: "#1e88e5",
    Phase.EVAL.value: "#7986cb",
    Phase.PUBLISH.value: "#4db6ac",
    Phase.REPEATED.value: "#f06292",
    Phase.HANG.value: "#b71c1c",
    Phase.NODE_LOST.value: "#880e4f",
    Phase.SHUTDOWN.value: "#616161",
    Phase.OTHER.value: "#e0e0e0",
    LOST: "#e53935",
}


def _visible_phases(summary: Summary) -> list[str]:
    return [p for p in PHASE_NAMES if summary.phases.get(p, 0.0) > 0.0005 or p == Phase.TRAIN.value]


def render_table(summary: Summary, title: str | None = None) -> Table:
    wall = summary.wall_s or 1.0
    status = _status(summary)
    table = Table(
        title=title or f"ETT {summary.ett_percent:.1f}% of {summary.wall_s:.1f}s wall",
        caption=f"{len(summary.attempts)} attempt(s), {status}; effective = train; "
        f"lost = steps a later attempt re-ran ({summary.lost_s:.1f}s)",
    )
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("% of wall", justify="right")
    table.add_column("", min_width=20)
    for phase in sorted(_visible_phases(summary), key=lambda p: -summary.phases[p]):
        seconds = summary.phases[phase]
        bar = "█" * round(20 * seconds / wall)
        style = "bold green" if phase == Phase.TRAIN.value else ("red" if phase == LOST else "")
        table.add_row(phase, f"{seconds:.2f}", f"{100 * seconds / wall:.1f}", bar, style=style)
    return table


def _status(summary: Summary) -> str:
    """How the job stands, in the table's caption: the launcher's last word where it left one."""
    if summary.completed:
        return "finished"
    if _stopped(summary):
        return "stopped"
    for ended in ("gave up", "launcher error"):  # the launcher's last words (lightning_ett/launch/launcher.py)
        if summary.outcome and summary.outcome.startswith(ended):
            return ended
    return "running or failed"  # no last word: still running, or a job not started by `lightning run` that failed


def _stopped(summary: Summary) -> bool:
    """Did a signal to the launcher (Ctrl-C, a scheduler's SIGTERM) stop the job? Its last word says so."""
    return bool(summary.outcome and summary.outcome.startswith("stopped by "))


def render_attempts(summary: Summary) -> Table:
    """One row per attempt: which steps it ran and how it ended (the launcher's words on failures)."""
    outcome = summary.outcome
    said = summary.attempts[-1].failure if summary.attempts else None
    if outcome and said and outcome.endswith(f"; last failure: {said}"):  # the last row says it: once is enough
        outcome = outcome[: -len(said) - len("; last failure: ")] + "; last failure: above"
    table = Table(title="attempts", caption=f"job: {escape(outcome)}" if outcome else None)
    for name in ("attempt", "ranks", "steps", "seconds", "ended"):
        table.add_column(name, justify="right" if name in ("attempt", "seconds") else "left")
    for info in summary.attempts:
        steps = f"{info.first_step}..{info.last_step}" if info.first_step is not None else "-"
        if info.completed:
            ended = "finished" if info.ranks else "finished (exited before recording any phase)"
        elif info.stopped is not None:  # (not its ranks' SIGTERMException: the stop was asked for)
            ended = "stopped (below)" if info.stopped == summary.outcome else info.stopped
        else:
            ended = info.failure or "no status (killed, or still running)"
        ranks = ",".join(map(str, info.ranks)) if info.ranks else "-"
        table.add_row(str(info.attempt), ranks, steps, f"{info.end - info.start:.1f}", escape(ended),
                      style="" if info.completed or info.stopped is not None else "red")
    return table


def fact_lines(summary: Summary) -> list[str]:
    """What the components stated about the job (Timeline.fact), in words: cadence, publishing, stragglers.

    A fact with missing or mistyped fields (a hand-edited or foreign ledger) is left out.
    """
    try:
        return _fact_lines(summary)
    except (KeyError, TypeError, ValueError, IndexError):
        return []


def _fact_lines(summary: Summary) -> list[str]:
    lines = []
    cadence = summary.facts_named(CADENCE_FACT)
    if cadence:
        lines.append(f"checkpoint cadence: {cadence_line(cadence[-1])}")
    published, errors = summary.facts_named(PUBLISH_FACT), summary.facts_named(PUBLISH_ERROR_FACT)
    if published or errors:
        line = f"published models: {len(published)}"
        if published:
            p = published[-1]
            line += f", latest v{p['version']:06d} (step {p['step']}) at {p['path']}"
        if errors:
            line += f"; {len(errors)} publish error(s), last at step {errors[-1].get('step')}: {errors[-1].get('error')}"
        lines.append(line)
    sparse = summary.facts_named(SPARSE_2D_FACT)
    if sparse:
        f = sparse[-1]
        per_sync = f"{1000 * f['sync_s'] / f['syncs']:.1f} ms each" if f["syncs"] else "none yet"
        lines.append(f"2D sparse parallelism: tables sharded over groups of {f['sharding_group_size']} of "
                     f"{f['world_size']} ranks ({f['replicas']} replicas of each shard), averaged every "
                     f"{f['every_n_steps']} step(s): {f['syncs']} syncs of {f['payload_bytes'] / 2**20:.1f} MiB, "
                     f"{per_sync} (rank 0; part of train)"
                     + (f"; table lr x {f['lr_factor']:g} (replica_lr_scale)" if f.get("lr_factor", 1.0) != 1.0 else ""))
    fp8 = summary.facts_named(FP8_FACT)
    if fp8:
        f = fp8[-1]
        lines.append(f"FP8-safe and eligible ({f['recipe']}): {f['safe_and_eligible']} of {f['layers']} layers, "
                     f"{100 * f['flop_share']:.1f}% of GEMM FLOPs ({f['unsafe']} unsafe"
                     + (f", {f['turned_unsafe']} of them after being safe" if f.get("turned_unsafe") else "")
                     + f", {f['undecided']} undecided; FP8Probe, fp8_probe.json)")
    straggler = straggler_line(summary.stragglers)
    if straggler:
        lines.append(straggler)
    for event in summary.nodes:
        at = f"+{event['time'] - summary.job_start:.0f}s"
        if event["kind"] == "node_lost":
            lines.append(f"node {event['node_rank']} ({event['address']}) stopped responding at {at} (attempt "
                         f"{event['attempt']}; last heard {event['time'] - event['since']:.0f}s before)")
        else:
            lines.append(f"node {event['node_rank']} ({event['address']}) responding again at {at}")
    if summary.suspicions:
        first = summary.suspicions[0]
        lines.append(f"hang watch: {len(summary.suspicions)} silence(s) past a limit were work, not hangs (first: "
                     f"{first['limit_phase']} limit {first['limit_s']:g}s, rank {first['working_rank']}: "
                     f"{first['evidence']})")
    return lines


def print_report(summary: Summary, console: Console | None = None) -> None:
    console = console or Console()
    console.print(render_table(summary))
    if len(summary.attempts) > 1 or any(not a.completed for a in summary.attempts) or summary.outcome:
        console.print(render_attempts(summary))
    if not summary.per_rank and summary.attempts:
        console.print("[yellow]No training process recorded a phase, so there is no ETT% to measure: add "
                      "ETTMonitor() to the Trainer's callbacks (the table shows the launcher's view alone).[/yellow]")
    for line in fact_lines(summary):  # (a log file: one line each, not cut at 80 columns mid-path)
        console.print(escape(line), style="red" if "error" in line else "", soft_wrap=not console.is_terminal)
    if summary.torn_records:
        console.print(f"[yellow]{summary.torn_records} ledger line(s) skipped: torn by a kill mid-write, or not a "
                      "valid record.[/yellow]")


def render_png(summary: Summary, path: str | os.PathLike) -> Path:
    """Write the timeline-and-breakdown figure atomically to ``path``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted(summary.segments)
    phases = sorted(_visible_phases(summary), key=lambda p: summary.phases[p])
    fig, (ax_time, ax_bar) = plt.subplots(
        2, 1, figsize=(11, 2.2 + 0.35 * len(ranks) + 0.3 * len(phases)),
        gridspec_kw={"height_ratios": [max(len(ranks), 1) + 1, max(len(phases), 1)]},
    )
    t0 = summary.job_start
    for lane, rank in enumerate(ranks):
        bars = [(s.start - t0, s.end - s.start) for s in summary.segments[rank]]
        colors = [PHASE_COLORS.get(s.phase, "#000000") for s in summary.segments[rank]]
        ax_time.broken_barh(bars, (lane - 0.4, 0.8), facecolors=colors, linewidth=0)
    for info in summary.attempts[1:]:
        ax_time.axvline(info.start - t0, color="black", linestyle="--", linewidth=1)
        ax_time.text(info.start - t0, len(ranks) - 0.4, f" attempt {info.attempt}", fontsize=8, va="bottom")
    ax_time.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax_time.set_xlim(0, max(summary.wall_s, 1e-3))
    ax_time.set_xlabel("seconds since job start")
    ax_time.invert_yaxis()
    ax_time.set_title(
        f"ETT {summary.ett_percent:.1f}% of {summary.wall_s:.1f}s wall · {len(summary.attempts)} attempt(s) · "
        f"lost {summary.lost_s:.1f}s"
    )
    handles = [Patch(color=PHASE_COLORS[p], label=p) for p in reversed(phases)]
    ax_time.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)

    values = [summary.phases[p] for p in phases]
    ax_bar.barh(phases, values, color=[PHASE_COLORS[p] for p in phases])
    wall = summary.wall_s or 1.0
    for y, v in enumerate(values):
        ax_bar.text(v, y, f" {v:.2f}s ({100 * v / wall:.1f}%)", va="center", fontsize=8)
    ax_bar.set_xlabel("seconds (mean over ranks)")
    ax_bar.set_xlim(0, max(values + [1e-3]) * 1.3)
    fig.tight_layout()

    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    return atomic_write_bytes(path, image.getvalue())


def write_report(summary: Summary, run_dir: str | os.PathLike, console: Console | None = None, show: bool = True) -> None:
    """Everything a finished job leaves behind: JSON, PNG, and (optionally) the printed table."""
    render_png(summary, Path(run_dir) / REPORT_PNG)  # (first: a JSON that says "done" comes with its PNG)
    summary.write_json(run_dir)
    if show:
        print_report(summary, console)
