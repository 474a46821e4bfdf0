"""The planner's all-reduce model against real collectives on this machine.

Times flat, hierarchical and torus all-reduces with gloo over loopback, one thread per process, on
2, 3, 4 and 6 processes and messages of 1 KB to 64 MB. Flat is the engine's own all-reduce; the
two-level ones go through the trainer's DDP hook (TorchDistributed._two_level_hook) on a grid of
lines of 2 ranks (lines of 3 on 3 processes). Then it fits this machine's one latency and one
bandwidth term to the 2- and 3-process times, through the planner's cost model (train/plan/comm.py:
the same rounds and bytes per algorithm), predicts the 4- and 6-process times, and prints last
`allreduce_model: E (goal <= 0.25)`, E the median relative error of those predictions.

Loopback has one kind of link, so the fit sets the in-node and the between-node link alike. Ranks
beyond the machine's cores take turns on them: every time is scaled by max(1, ranks / cores), a
fact of this machine, not a fitted term.

    python scripts/bench/allreduce.py            # the full bench, under 10 minutes on 2 cores
    python scripts/bench/allreduce.py --quick    # 3 sizes, 2 repeats: a smoke check
"""
import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

ALGORITHMS = ("flat", "hierarchical", "torus")
FIT_PROCS, CHECK_PROCS = (2, 3), (4, 6)


def rows_for(procs: int) -> int:
    """The grid's line length: 2 where it divides the ranks, else one line of all of them."""
    return 2 if procs % 2 == 0 else procs


class _Bucket:
    """What the DDP hook reads of a gradient bucket."""

    def __init__(self, tensor, index):
        self._tensor, self._index = tensor, index

    def buffer(self):
        return self._tensor

    def index(self):
        return self._index


def worker(rank: int, procs: int, port: int, sizes: list[int], repeats: int, seconds: float, out: str) -> None:
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(procs), "LOCAL_RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
    import torch
    import torch.distributed as dist
    from train.config import Config
    from train.engines.torch_distributed import TorchDistributed
    torch.set_num_threads(1)
    rows = rows_for(procs)
    base = Config(allreduce="flat", ranks_per_node=rows, torus_rows=rows)
    engine = TorchDistributed(base)
    times = {}
    for algorithm in ALGORITHMS:
        engine.cfg = dataclasses.replace(base, allreduce=algorithm)
        state = engine._two_level_state() if algorithm != "flat" else None
        for index, size in enumerate(sizes):
            tensor = torch.ones(size // 4)

            def once():
                if state is None:
                    engine.all_reduce_sum(tensor)
                else:
                    engine._two_level_hook(state, _Bucket(tensor, index)).wait()
            once()  # warm-up: buffers, connections
            samples, started = [], time.perf_counter()
            while True:
                dist.barrier()
                begin = time.perf_counter()
                once()
                elapsed = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
                samples.append(elapsed.item())
                # every rank goes on or stops as rank 0's clock says: the same collectives everywhere
                more = len(samples) < repeats or (time.perf_counter() - started < seconds and len(samples) < 20)
                go_on = torch.tensor([float(more)])
                dist.broadcast(go_on, 0)
                if not go_on.item():
                    break
            times[f"{algorithm}/{size}"] = statistics.median(samples)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    engine.shutdown()


def measure(procs: int, sizes: list[int], repeats: int, seconds: float, port: int) -> dict:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.spawn(worker, args=(procs, port, sizes, repeats, seconds, out), nprocs=procs)
        return json.loads(Path(out).read_text())


def features(algorithm: str, procs: int, nbytes: int, cores: int) -> tuple[float, float]:
    """The planner's model as latency x f1 + seconds-per-byte x f2 (it is linear in both)."""
    from train.plan.comm import Cluster, allreduce_time
    from train.plan.hardware import Link
    rows, turns = rows_for(procs), max(1.0, procs / cores)

    def model(link):
        return turns * allreduce_time(Cluster(procs, rows, link, link), nbytes, algorithm, rows)
    return model(Link(1.0, float("inf"))), model(Link(0.0, 1.0))


def fit(samples: list[tuple[tuple[float, float], float]]) -> tuple[float, float]:
    """(latency, seconds per byte) minimising the squared relative error."""
    import numpy as np
    a = np.array([[f1 / t, f2 / t] for (f1, f2), t in samples])
    (latency, per_byte), *_ = np.linalg.lstsq(a, np.ones(len(samples)), rcond=None)
    return float(latency), float(per_byte)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 sizes, 2 repeats: a smoke check")
    p.add_argument("--port", type=int, default=29611)
    args = p.parse_args()
    sizes = [4 << 10, 256 << 10, 4 << 20] if args.quick else [1 << (10 + 2 * k) for k in range(9)]  # 1 KB .. 64 MB
    repeats, seconds = (2, 0.0) if args.quick else (3, 0.6)
    cores = os.cpu_count() or 1
    measured = {}
    for offset, procs in enumerate(FIT_PROCS + CHECK_PROCS):
        started = time.perf_counter()
        measured[procs] = measure(procs, sizes, repeats, seconds, args.port + offset)
        print(f"{procs} processes measured in {time.perf_counter() - started:.0f} s", flush=True)

    samples = [(features(alg, procs, size, cores), measured[procs][f"{alg}/{size}"])
               for procs in FIT_PROCS for alg in ALGORITHMS for size in sizes]
    latency, per_byte = fit(samples)
    print(f"fitted on {', '.join(map(str, FIT_PROCS))} processes ({cores} cores): latency {latency * 1e6:.1f} us, "
          f"bandwidth {1 / per_byte / 1e9:.3f} GB/s" if per_byte > 0 else f"fit failed: per byte {per_byte}")
    print(f"{'procs':>5} {'algorithm':>12} {'bytes':>10} {'measured ms':>12} {'model ms':>10} {'error':>7}")
    errors = []
    for procs in FIT_PROCS + CHECK_PROCS:
        for alg in ALGORITHMS:
            for size in sizes:
                f1, f2 = features(alg, procs, size, cores)
                model, real = latency * f1 + per_byte * f2, measured[procs][f"{alg}/{size}"]
                error = abs(model - real) / real
                if procs in CHECK_PROCS:
                    errors.append(error)
                print(f"{procs:>5} {alg:>12} {size:>10} {real * 1e3:>12.3f} {model * 1e3:>10.3f} {error:>7.1%}"
                      + ("" if procs in CHECK_PROCS else "  (fit)"))
    print(f"allreduce_model: {statistics.median(errors):.3f} (goal <= 0.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
