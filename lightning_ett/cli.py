"""``lightning-ett`` command line: ``report`` reads a job's ledger back."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console


def _report(args: argparse.Namespace) -> int:
    from lightning_ett.report import REPORT_PNG, write_report
    from lightning_ett.summary import SUMMARY_FILE, summarize_run_dir

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        print(f"lightning-ett report: RUN_DIR {str(run_dir)!r} is not a directory.", file=sys.stderr)
        return 2
    try:
        summary = summarize_run_dir(run_dir, now=time.time() if args.now else None)
    except (FileNotFoundError, ValueError) as err:
        print(f"lightning-ett report: {err}", file=sys.stderr)
        return 2
    console = Console()
    write_report(summary, run_dir, console)
    console.print(f"[dim]{run_dir / SUMMARY_FILE}\n{run_dir / REPORT_PNG}[/dim]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-ett", description="Effective Training Time tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    report = sub.add_parser("report", help="Print the ETT table and write ett_summary.json and the PNG for a run.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="The job's run directory (holds ledger/).")
    report.add_argument(
        "--now", action="store_true", help="For a running job: count wall time up to now, not the last event."
    )
    report.set_defaults(func=_report)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
