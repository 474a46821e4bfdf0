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

--cluster DIR (a cluster of 3 or more nodes made by scripts/cluster.sh) measures across nodes instead:
the data links shaped to --link-rate (300 Mbit/s: the network, not the 2 cores, is the bottleneck),
flat and hierarchical all-reduces of ResNet-50's gradient (25,557,032 values, fp32 and fp16) over
2 and 3 nodes x 1 and 2 ranks (TRAINER_IFACE=data0, the nodes from the host names), medians of 3;
each against the planner's comm_total_s for that link (`python -m train.plan --network custom
--link-gbps G --latency-us L`, G the shaped rate), last line `allreduce_model_cluster: E (goal <=
0.15)`, E the median relative error.

    python scripts/bench/allreduce.py --cluster /tmp/c --link-rate 300mbit
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


RESNET50_VALUES = 25_557_032  # ResNet-50's parameters: its gradient
CLUSTER_LAYOUTS = ((2, 1), (2, 2), (3, 1), (3, 2))  # (nodes, ranks per node)
WIRES = {"fp32": 4, "fp16": 2}


def cluster_worker(out: str, repeats: int) -> None:
    """One rank of a cluster measurement (RANK, WORLD_SIZE, MASTER_ADDR set by cluster_measure):
    rank 0 writes {algorithm/wire: median seconds} to `out`."""
    import torch
    import torch.distributed as dist
    from train.config import Config
    from train.engines import use_interface
    from train.engines.torch_distributed import TorchDistributed
    use_interface()  # TRAINER_IFACE=data0: the shaped data network
    torch.set_num_threads(1)
    engine = TorchDistributed(Config(allreduce="flat"))  # the nodes from the host names
    times = {}
    for algorithm in ("flat", "hierarchical"):
        engine.cfg = Config(allreduce=algorithm)
        state = engine._two_level_state() if algorithm != "flat" else None
        for index, (wire, size) in enumerate(WIRES.items()):
            tensor = torch.ones(RESNET50_VALUES, dtype=torch.float32 if size == 4 else torch.float16)

            def once():
                if state is None:
                    dist.all_reduce(tensor)
                else:
                    engine._two_level_hook(state, _Bucket(tensor, index)).wait()
            samples = []
            for _ in range(repeats):
                dist.barrier()
                begin = time.perf_counter()
                once()
                elapsed = torch.tensor([time.perf_counter() - begin], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
                samples.append(elapsed.item())
            times[f"{algorithm}/{wire}"] = statistics.median(samples)
    if engine.rank == 0:
        Path(out).write_text(json.dumps(times))
    engine.shutdown()


def cluster_measure(folder: Path, nodes: int, per_node: int, repeats: int, port: int) -> dict:
    import subprocess
    out = folder / "shared" / f"allreduce-{nodes}x{per_node}.json"
    out.unlink(missing_ok=True)
    world, processes = nodes * per_node, []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
               "MASTER_ADDR": "node1", "MASTER_PORT": str(port), "TRAINER_IFACE": "data0", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(REPO)}
        node = f"node{rank // per_node + 1}"
        processes.append(subprocess.Popen(["bash", str(REPO / "scripts" / "cluster.sh"), "exec", str(folder), node, "--",
                                           sys.executable, __file__, "--cluster-worker", str(out),
                                           "--repeats", str(repeats)], env=env))
    if any(p.wait() for p in processes):
        raise SystemExit(f"a worker of {nodes} x {per_node} failed")
    return json.loads(out.read_text())


def planned(nodes: int, per_node: int, algorithm: str, wire: str, gbps: float, latency_us: float) -> float:
    """The planner's comm_total_s for this layout over a custom link of `gbps` and `latency_us`."""
    import subprocess
    command = [sys.executable, "-m", "train.plan", "--gpus", str(nodes * per_node), "--gpu", "v100",
               "--gpus-per-node", str(per_node), "--links-per-node", "1", "--allreduce", algorithm, "--wire", wire,
               "--json", "--network", "custom", "--link-gbps", str(gbps), "--latency-us", str(latency_us)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode:
        raise SystemExit(f"the planner refused {' '.join(command)}: {done.stderr.strip()}")
    return json.loads(done.stdout)[0]["comm_total_s"]


def rate_gbps(rate: str) -> float:
    """tc's rate (300mbit, 1gbit, 500kbit) in Gbit/s."""
    import re
    number, unit = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate).groups()
    return float(number) * {"": 1e-9, "k": 1e-6, "m": 1e-3, "g": 1.0}[unit]


def cluster_main(folder: Path, rate: str, latency_us: float, repeats: int, port: int) -> int:
    import subprocess
    env_file = folder / "cluster.env"
    nodes = int(dict(line.split("=", 1) for line in env_file.read_text().split())["nodes"]) if env_file.exists() else 0
    if nodes < 3:
        raise SystemExit(f"--cluster {folder}: needs a cluster of 3 or more nodes: bash scripts/cluster.sh up {folder} --nodes 3")
    gbps = rate_gbps(rate)
    for node in range(1, nodes + 1):
        subprocess.run(["bash", str(REPO / "scripts" / "cluster.sh"), "link", str(folder), f"node{node}", "rate", rate], check=True)
    print(f"data links shaped to {rate} ({gbps:g} Gbit/s each way); the planner's link: {gbps:g} Gbit/s, {latency_us:g} us")
    print(f"{'nodes':>5} {'ranks':>5} {'algorithm':>12} {'wire':>5} {'measured s':>11} {'model s':>8} {'error':>7}")
    errors = []
    try:
        for offset, (count, per_node) in enumerate(CLUSTER_LAYOUTS):
            measured = cluster_measure(folder, count, per_node, repeats, port + offset)
            for key, seconds in measured.items():
                algorithm, wire = key.split("/")
                model = planned(count, per_node, algorithm, wire, gbps, latency_us)
                errors.append(abs(model - seconds) / seconds)
                print(f"{count:>5} {per_node:>5} {algorithm:>12} {wire:>5} {seconds:>11.3f} {model:>8.3f} {errors[-1]:>7.1%}",
                      flush=True)
    finally:
        for node in range(1, nodes + 1):
            subprocess.run(["bash", str(REPO / "scripts" / "cluster.sh"), "link", str(folder), f"node{node}", "rate", "none"])
    print(f"allreduce_model_cluster: {statistics.median(errors):.3f} (goal <= 0.15)")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 sizes, 2 repeats: a smoke check")
    p.add_argument("--port", type=int, default=29611)
    p.add_argument("--cluster", help="a folder of scripts/cluster.sh with 3 or more nodes: measure across them")
    p.add_argument("--link-rate", default="300mbit", help="--cluster: the data links' rate, in tc's syntax")
    p.add_argument("--latency-us", type=float, default=50.0, help="--cluster: the link latency given to the planner")
    p.add_argument("--repeats", type=int, default=3, help="--cluster: timed all-reduces per configuration (median)")
    p.add_argument("--cluster-worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cluster_worker:
        cluster_worker(args.cluster_worker, args.repeats)
        return 0
    if args.cluster:
        return cluster_main(Path(args.cluster).resolve(), args.link_rate, args.latency_us, args.repeats, args.port)
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
