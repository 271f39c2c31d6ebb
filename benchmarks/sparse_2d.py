"""2D sparse parallelism vs 1D on the example DLRM (4 gloo ranks), counted; then a projection to 4,096 ranks.

    .venv/bin/python benchmarks/sparse_2d.py [--rounds 3] [--steps 150] [--intervals 1 4 16]

Every round is one launch of benchmarks/sparse_2d_job.py on 4 ranks (Lightning's launcher,
gloo) that trains the example DLRM (26 tables x 20,000 x 16, batch 256 per rank, table-wise)
once per arm: 1D, and 2D with K = 2 at each replica-sync interval; the arms' order rotates
from round to round. Measured per arm: the bytes each rank sends to other ranks in the
embedding all-to-alls per step (counted at ``all_to_all_single``), the ranks each all-to-all
spans, the replica sync's payload and time per sync, the median step time, and the time of
a synchronous ``trainer.save_checkpoint`` (slowest rank) with each rank's table bytes written
(2D: also with the rows written by DCP's dedup of whole shards, and by one sharding group).

Then the projection model (:func:`a2a_bytes_per_rank` and friends; assumptions in
benchmarks/README.md) is checked against the counted bytes at N = 4 (goal: within 5 %, 1D
and 2D) and printed for N = 8 … 4,096 ranks and K in {8, 64, N}. It is a projection, not a
measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from spread import median_range

# The example DLRM (examples/dlrm.yaml) as this benchmark trains it.
TABLES, ROWS, DIM, IDS_PER_SAMPLE, BATCH = 26, 20_000, 16, 2, 256
FLOAT, ID, LENGTH = 4, 8, 4  # bytes: fp32 embeddings, int64 ids, int32 lengths
SPLITS_PER_PEER = 3 * ID  # TorchRec's KJT input distribution first exchanges 3 int64 counts with every peer


# ---------------------------------------------------------------------- the projection model
def shards(group: int) -> float:
    """Table shards in a group: table-wise while there are ranks enough; beyond, each table in G/T column shards."""
    return float(max(TABLES, group))


def a2a_bytes_per_rank(group: int, batch: int = BATCH) -> float:
    """Bytes a rank sends to its peers per step, averaged over ranks: ids forward, pooled embeddings forward,
    their gradients backward (each rank's share of the group's tables), and the splits exchange."""
    peers = (group - 1) / group
    embeddings = 2 * TABLES * DIM * FLOAT * batch * peers
    ids = shards(group) * batch * (LENGTH + IDS_PER_SAMPLE * ID) * peers
    return embeddings + ids + SPLITS_PER_PEER * (group - 1)


def message_bytes_per_peer(group: int, batch: int = BATCH) -> float:
    """One forward embedding message: this rank's share of the pooled columns, for one peer's samples."""
    return TABLES * DIM * FLOAT * batch / group


def embedding_memory_per_rank(group: int) -> float:
    """Table weights plus row-wise AdaGrad state (one fp32 per row), a group's share."""
    return TABLES * ROWS * (DIM + 1) * FLOAT / group


def replica_sync_bytes_per_rank(world: int, group: int) -> float:
    """A ring all-reduce of the rank's shards over the N/K replicas sends 2 (R-1)/R of them."""
    replicas = world // group
    return 2 * (replicas - 1) / replicas * embedding_memory_per_rank(group) if replicas > 1 else 0.0


# ---------------------------------------------------------------------- measuring
def run_round(arms: list[dict], args: argparse.Namespace, out: Path) -> list[list[dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env["PYTHONPATH"] = str(HERE.parent)
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(HERE / "sparse_2d_job.py"), "--out", str(out), "--arms", json.dumps(arms),
                           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(BATCH),
                           "--rows", str(ROWS), "--dim", str(DIM), "--saves", str(args.saves)],
                          env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


def mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--saves", type=int, default=3)
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    arms = [{"name": "1D", "k": None, "interval": 1}]
    arms += [{"name": f"2D K=2, sync every {n}", "k": 2, "interval": n} for n in args.intervals]
    by_arm: dict[str, list[list[dict]]] = {a["name"]: [] for a in arms}  # per round: the 4 ranks' results
    with tempfile.TemporaryDirectory(prefix="ett-sparse-2d-") as tmp:
        for r in range(args.rounds):
            order = arms[r % len(arms):] + arms[:r % len(arms)]
            print(f"round {r + 1}/{args.rounds}: {', '.join(a['name'] for a in order)}", flush=True)
            ranks = run_round(order, args, Path(tmp) / f"round-{r}")
            for i, arm in enumerate(order):
                by_arm[arm["name"]].append([rank[i] for rank in ranks])

    print("\n## Counted on 4 ranks (bytes each rank sends to other ranks per step; mean over ranks, max)\n")
    print("| arm | all-to-all group | all-to-all bytes/rank/step | max rank | model | model error | "
          "embedding memory/rank | median step (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    worst_error = 0.0
    for name, rounds in by_arm.items():
        first = rounds[0]
        per_rank = [sum(r["a2a_bytes_per_step"].values()) for r in first]
        groups = sorted({int(key.split("/")[-1]) for r in first for key in r["a2a_bytes_per_step"]})
        model = a2a_bytes_per_rank(groups[0])
        error = abs(statistics.mean(per_rank) - model) / model
        worst_error = max(worst_error, error)
        steps = [statistics.median(r["step_s_median"] for r in ranks) * 1000 for ranks in rounds]
        memory = max(r["embedding_memory_bytes"] for r in first)
        print(f"| {name} | {groups} | {mib(statistics.mean(per_rank))} | {mib(max(per_rank))} | {mib(model)} | "
              f"{100 * error:.2f} % | {mib(memory)} | {median_range(steps, '.1f')} |")
    print(f"\nModel vs counted at N = 4: worst error {100 * worst_error:.2f} % (goal <= 5 %: "
          f"{'met' if worst_error <= 0.05 else 'NOT met'})")

    print("\n## Replica sync (2D, K = 2: 2 replicas of each shard) against the interval\n")
    print("| interval | payload/rank/sync | model ring bytes sent/rank/sync | time per sync (ms) | per step (ms) | "
          "median step (ms) |")
    print("|---|---|---|---|---|---|")
    for name, rounds in by_arm.items():
        first = rounds[0][0]
        if first["arm"]["k"] is None:
            continue
        interval = first["arm"]["interval"]
        per_sync = [statistics.median(r["sync_s_per_sync"] for r in ranks) * 1000 for ranks in rounds]
        steps = [statistics.median(r["step_s_median"] for r in ranks) * 1000 for ranks in rounds]
        print(f"| {interval} | {mib(first['sync_payload_bytes'])} | {mib(replica_sync_bytes_per_rank(4, 2))} | "
              f"{median_range(per_sync, '.1f')} | {statistics.median(per_sync) / interval:.1f} | "
              f"{median_range(steps, '.1f')} |")

    print("\n## Checkpoint write, synchronous trainer.save_checkpoint (slowest rank), same tables, same 4 ranks\n")
    print("| arm | who writes the table rows | table bytes written, max rank | min rank | save (s) |")
    print("|---|---|---|---|---|")
    save_medians = {}
    for name, rounds in by_arm.items():
        for writers, written in rounds[0][0]["written_table_bytes"].items():
            saves = [s for ranks in rounds for s in ranks[0]["save_s"][writers]]
            save_medians[(name, writers)] = statistics.median(saves)
            print(f"| {name} | {writers} | {mib(max(written.values()))} | {mib(min(written.values()))} | "
                  f"{median_range(saves, '.3f')} |")
    two_d = [v for (name, writers), v in save_medians.items() if name != "1D" and writers == "spread"]
    ratio = statistics.median(two_d) / save_medians[("1D", "each rank its shards")]
    print(f"\n2D save (rows spread over replicas) / 1D save, medians: {ratio:.3f}")

    print("\n## Projection (a model, not a measurement): the same tables, batch 256 per rank\n")
    print("| N | K | all-to-all group | all-to-all bytes/rank/step | message/peer | embedding memory/rank | "
          "replica sync bytes/rank/sync |")
    print("|---|---|---|---|---|---|---|")
    world = 8
    while world <= 4096:
        for k in sorted({k for k in (8, 64, world) if k <= world}):
            label = f"{k} (1D)" if k == world else str(k)
            print(f"| {world} | {label} | {k} | {mib(a2a_bytes_per_rank(k))} | {mib(message_bytes_per_peer(k))} | "
                  f"{mib(embedding_memory_per_rank(k))} | {mib(replica_sync_bytes_per_rank(world, k))} |")
        world *= 2


if __name__ == "__main__":
    main()
