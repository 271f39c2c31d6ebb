"""2D sparse parallelism vs 1D on the example DLRM (4 and 8 gloo ranks), counted twice; then a projection to 4,096 ranks.

    .venv/bin/python benchmarks/sparse_2d.py [--rounds 3] [--steps 150] [--intervals 1 4 16] [--worlds 4 8]

Every round is one launch of benchmarks/sparse_2d_job.py per world size N (Lightning's launcher,
gloo) that trains the example DLRM (26 tables x 20,000 x 16, batch 256 per rank) once per arm:
1D table-wise, 1D column-wise (every table in 4 column shards: the projection's regime beyond 26
ranks, reached here with few ranks), and 2D (N = 4: K = 2 at each replica-sync interval; N = 8:
K = 4, sync every 4), and 1D table-wise again (the A/A control: the step-time noise floor); the arms'
order per round is ``round_order``'s. Measured per arm:

* bytes each rank sends to other ranks in the embedding all-to-alls per step, counted at
  ``all_to_all_single``, and the ranks each all-to-all spans;
* independently of that wrapper, the loopback interface's transmit counter
  (``/sys/class/net/lo/statistics/tx_bytes``) around the counted steps: every rank's traffic
  (all-to-alls, replica sync, the dense all-reduce, TCP/IP headers), divided by N and the steps;
* the replica sync's payload and time per sync; the step time as the whole counted window ÷ its
  steps (syncs included), and the median step;
* N = 4: the time of a synchronous ``trainer.save_checkpoint`` (slowest rank) with each rank's
  table bytes written (2D: also with the rows written by DCP's dedup of whole shards, and by one
  sharding group).

Then the projection model (:func:`a2a_bytes_per_rank` and friends; assumptions in
benchmarks/README.md) is checked against the counted bytes (goal: within 5 %) and printed for
N = 8 … 4,096 ranks and K in {8, 64, N}, leaving out layouts that need more column shards than
the tables have 4-column slices. It is a projection, not a measurement.
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
from spread import aa_floor, against_floor, median_range, round_order

# The example DLRM (examples/dlrm.yaml) as this benchmark trains it.
TABLES, ROWS, DIM, IDS_PER_SAMPLE, BATCH = 26, 20_000, 16, 2, 256
FLOAT, ID, LENGTH = 4, 8, 4  # bytes: fp32 embeddings, int64 ids, int32 lengths
SPLITS_PER_PEER = 3 * ID  # TorchRec's KJT input distribution first exchanges 3 int64 counts with every peer


# ---------------------------------------------------------------------- the projection model
MAX_COLUMN_SHARDS = DIM // 4  # fbgemm's column shards are multiples of 4 columns


def shards(group: int) -> float:
    """Table shards in a group: table-wise while there are ranks enough; beyond, each table in G/T column shards."""
    return float(max(TABLES, group))


def possible(group: int) -> bool:
    """Whether the projection's layout exists: at most DIM/4 column shards of 4 columns per table."""
    return group <= TABLES * MAX_COLUMN_SHARDS


def a2a_bytes_per_rank(group: int, batch: int = BATCH, table_shards: float | None = None) -> float:
    """Bytes a rank sends to its peers per step, averaged over ranks: ids forward (to every shard of
    a feature's table), pooled embeddings forward, their gradients backward (each rank's share of
    the group's tables), and the splits exchange. ``table_shards``: the plan's, else :func:`shards`."""
    peers = (group - 1) / group
    embeddings = 2 * TABLES * DIM * FLOAT * batch * peers
    ids = (table_shards or shards(group)) * batch * (LENGTH + IDS_PER_SAMPLE * ID) * peers
    return embeddings + ids + SPLITS_PER_PEER * (group - 1)


def ring_bytes(payload: float, ranks: int) -> float:
    """A ring all-reduce over ``ranks`` sends 2 (n-1)/n of the payload from every rank."""
    return 2 * (ranks - 1) / ranks * payload if ranks > 1 else 0.0


def message_bytes_per_peer(group: int, batch: int = BATCH) -> float:
    """One forward embedding message: this rank's share of the pooled columns, for one peer's samples."""
    return TABLES * DIM * FLOAT * batch / group


def embedding_memory_per_rank(group: int) -> float:
    """Table weights plus row-wise AdaGrad state (one fp32 per row), a group's share."""
    return TABLES * ROWS * (DIM + 1) * FLOAT / group


def replica_sync_bytes_per_rank(world: int, group: int) -> float:
    """A ring all-reduce of the rank's shards over the N/K replicas sends 2 (R-1)/R of them."""
    return ring_bytes(embedding_memory_per_rank(group), world // group)


# ---------------------------------------------------------------------- measuring
def run_round(arms: list[dict], args: argparse.Namespace, out: Path, world: int) -> list[list[dict]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIGHTNING_ETT_")}
    env["PYTHONPATH"] = str(HERE.parent)
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(HERE / "sparse_2d_job.py"), "--out", str(out), "--arms", json.dumps(arms),
                           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(BATCH),
                           "--rows", str(ROWS), "--dim", str(DIM), "--saves", str(args.saves if world == 4 else 0),
                           "--devices", str(world)],
                          env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-4000:])
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def mib(n: float) -> str:
    return f"{n / 2**20:.3f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def world_arms(world: int, intervals: list[int]) -> list[dict]:
    arms = [{"name": f"N={world} 1D", "k": None, "interval": 1},
            {"name": f"N={world} 1D column-wise", "k": None, "interval": 1, "sharding": "column_wise"}]
    if world == 4:
        arms += [{"name": f"N=4 2D K=2, sync every {n}", "k": 2, "interval": n} for n in intervals]
    else:
        arms += [{"name": f"N={world} 2D K={world // 2}, sync every 4", "k": world // 2, "interval": 4}]
    return arms + [{"name": f"N={world} 1D A/A", "k": None, "interval": 1}]


def step_ratios(by_arm: dict[str, list[list[dict]]], worlds: list[int]) -> None:
    """Each arm's step (window ÷ steps) ÷ 1D's in the same launch, per round, beside the A/A's: a difference
    inside the A/A's spread is none."""
    print("\n## Step (window ÷ steps) ÷ the same launch's 1D table-wise step, per round: median (min-max)\n")
    for world in worlds:
        base = [statistics.median(r["step_s_mean"] for r in ranks) for ranks in by_arm[f"N={world} 1D"]]
        aa = [statistics.median(r["step_s_mean"] for r in ranks) / b for ranks, b in zip(by_arm[f"N={world} 1D A/A"], base)]
        floor = aa_floor(aa)
        print(f"N = {world}: A/A {median_range(aa, '.3f')} (floor ±{floor:.3f})")
        for name, rounds in by_arm.items():
            if len(rounds[0]) != world or name in (f"N={world} 1D", f"N={world} 1D A/A"):
                continue
            ratios = [statistics.median(r["step_s_mean"] for r in ranks) / b for ranks, b in zip(rounds, base)]
            print(f"  {name}: {median_range(ratios, '.3f')} ({against_floor(ratios, floor)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--saves", type=int, default=3, help="synchronous saves per arm (N = 4 only)")
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8])
    args = parser.parse_args()
    arms_of = {w: world_arms(w, args.intervals) for w in args.worlds}
    by_arm: dict[str, list[list[dict]]] = {a["name"]: [] for w in args.worlds for a in arms_of[w]}  # per round: ranks
    with tempfile.TemporaryDirectory(prefix="ett-sparse-2d-") as tmp:
        for r in range(args.rounds):
            for world in args.worlds:
                arms = arms_of[world]
                order = round_order(arms, r)
                print(f"round {r + 1}/{args.rounds}, N = {world}: {', '.join(a['name'] for a in order)}", flush=True)
                ranks = run_round(order, args, Path(tmp) / f"round-{r}-{world}", world)
                for i, arm in enumerate(order):
                    by_arm[arm["name"]].append([rank[i] for rank in ranks])

    print("\n## Counted (bytes each rank sends to other ranks per step; mean over ranks, max rank)\n")
    print("| arm | all-to-all group | table shards | all-to-all bytes/rank/step (max rank) | model | model error | "
          "replica sync bytes/rank/step | total bytes/rank/step | loopback bytes/rank/step | loopback ÷ total | "
          "embedding memory/rank | step, window ÷ steps (ms) | median step (ms) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    worst_error = 0.0
    for name, rounds in by_arm.items():
        first = rounds[0]
        world = len(first)
        per_rank = [sum(r["a2a_bytes_per_step"].values()) for r in first]
        groups = sorted({int(key.split("/")[-1]) for r in first for key in r["a2a_bytes_per_step"]})
        model = a2a_bytes_per_rank(groups[0], table_shards=first[0]["table_shards"])
        error = abs(statistics.mean(per_rank) - model) / model
        worst_error = max(worst_error, error)
        arm = first[0]["arm"]
        replicas = world // arm["k"] if arm["k"] else 1
        sync = ring_bytes(statistics.mean(r["sync_payload_bytes"] for r in first), replicas) / arm["interval"]
        dense = ring_bytes(first[0]["dense_bytes"], world)  # DDP's all-reduce of the dense gradients (ring)
        total = statistics.mean(per_rank) + sync
        # rank 0's reading of the host-wide counter, per rank
        loop = [rs[0]["loopback_bytes_per_step"] / world for rs in rounds if rs[0]["loopback_bytes_per_step"] is not None]
        loop_text = median_range([v / 2**10 for v in loop], ".1f") + " KiB" if loop else "unreadable"
        ratio = f"{statistics.median(loop) / (total + dense):.3f}" if loop else "-"
        means = [statistics.median(r["step_s_mean"] for r in ranks) * 1000 for ranks in rounds]
        steps = [statistics.median(r["step_s_median"] for r in ranks) * 1000 for ranks in rounds]
        memory = max(r["embedding_memory_bytes"] for r in first)
        print(f"| {name} | {groups} | {first[0]['table_shards']} | {mib(statistics.mean(per_rank))} ({mib(max(per_rank))}) | "
              f"{mib(model)} | {100 * error:.2f} % | {mib(sync)} | {mib(total)} | {loop_text} | {ratio} | {mib(memory)} | "
              f"{median_range(means, '.1f')} | {median_range(steps, '.1f')} |")
    print(f"\nModel vs counted: worst error {100 * worst_error:.2f} % (goal <= 5 %: "
          f"{'met' if worst_error <= 0.05 else 'NOT met'}). total = all-to-all + replica sync (ring model of its "
          "payload ÷ interval); loopback ÷ total divides the loopback bytes by total + the dense all-reduce "
          "(ring model of DDP's gradient bytes), i.e. everything the loop sends; the rest is TCP/IP headers and "
          "anything the models miss.")

    print("\n## Replica sync (2D) against the interval\n")
    print("| arm | payload/rank/sync | model ring bytes sent/rank/sync | time per sync (ms) | per step (ms) | "
          "step, window ÷ steps (ms) |")
    print("|---|---|---|---|---|---|")
    for name, rounds in by_arm.items():
        first = rounds[0][0]
        if first["arm"]["k"] is None:
            continue
        world, interval = len(rounds[0]), first["arm"]["interval"]
        per_sync = [statistics.median(r["sync_s_per_sync"] for r in ranks) * 1000 for ranks in rounds]
        means = [statistics.median(r["step_s_mean"] for r in ranks) * 1000 for ranks in rounds]
        print(f"| {name} | {mib(first['sync_payload_bytes'])} | "
              f"{mib(ring_bytes(first['sync_payload_bytes'], world // first['arm']['k']))} | "
              f"{median_range(per_sync, '.1f')} | {statistics.median(per_sync) / interval:.1f} | {median_range(means, '.1f')} |")

    step_ratios(by_arm, args.worlds)

    if 4 in args.worlds and args.saves:
        print("\n## Checkpoint write, synchronous trainer.save_checkpoint (slowest rank), same tables, N = 4\n")
        print("| arm | who writes the table rows | table bytes written, max rank | min rank | save (s) |")
        print("|---|---|---|---|---|")
        save_medians = {}
        for name, rounds in by_arm.items():
            for writers, written in rounds[0][0]["written_table_bytes"].items():
                saves = [s for ranks in rounds for s in ranks[0]["save_s"][writers]]
                save_medians[(name, writers)] = statistics.median(saves)
                print(f"| {name} | {writers} | {mib(max(written.values()))} | {mib(min(written.values()))} | "
                      f"{median_range(saves, '.3f')} |")
        two_d = [v for (name, writers), v in save_medians.items() if "2D" in name and writers == "spread"]
        ratio_2d = statistics.median(two_d) / save_medians[("N=4 1D", "each rank its shards")]
        print(f"\n2D save (rows spread over replicas) / 1D table-wise save, medians: {ratio_2d:.3f}")
        aa_save = save_medians[("N=4 1D A/A", "each rank its shards")] / save_medians[("N=4 1D", "each rank its shards")]
        print(f"A/A: 1D table-wise again / 1D table-wise save, medians: {aa_save:.3f}")

    print("\n## Projection (a model, not a measurement): the same tables, batch 256 per rank\n")
    print("| N | K | all-to-all group | all-to-all bytes/rank/step | message/peer | embedding memory/rank | "
          "replica sync bytes/rank/sync |")
    print("|---|---|---|---|---|---|---|")
    world, left_out = 8, []
    while world <= 4096:
        for k in sorted({k for k in (8, 64, world) if k <= world}):
            label = f"{k} (1D)" if k == world else str(k)
            if not possible(k):
                left_out.append(f"N={world} K={label}")
                continue
            print(f"| {world} | {label} | {k} | {mib(a2a_bytes_per_rank(k))} | {mib(message_bytes_per_peer(k))} | "
                  f"{mib(embedding_memory_per_rank(k))} | {mib(replica_sync_bytes_per_rank(world, k))} |")
        world *= 2
    print(f"\nLeft out (a group of more than {TABLES} x {MAX_COLUMN_SHARDS} = {TABLES * MAX_COLUMN_SHARDS} ranks needs more "
          f"column shards than {DIM}-column tables have 4-column slices): {', '.join(left_out)}")


if __name__ == "__main__":
    main()
