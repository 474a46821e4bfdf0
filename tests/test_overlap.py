"""The two-level all-reduces (--allreduce hierarchical, torus) overlap backward: the DDP hook returns
before its collectives complete and chains the later steps on their futures, in one order on every
rank whatever order they complete in; Horovod's optimizer issues a bucket's first step as soon as
its gradients are ready, and nothing during backward that depends on timing. And where Horovod runs
its own hierarchical all-reduce (NCCL + MPI on GPUs across nodes)."""
import json
import os
import time
import types

import pytest
import torch

from helpers import REPO, launch, stand_in_for_horovod
from train.engines import horovod as horovod_engine
from train.config import Config

pytestmark = pytest.mark.multiprocess


def run_check(engine: str, tmp_path) -> list[dict]:
    result = launch(engine, 4, REPO / "tests" / "helpers" / "overlap_check.py", engine, tmp_path,
                    cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]


def test_the_ddp_hook_returns_at_once_and_its_callbacks_keep_one_order_across_ranks(tmp_path):
    for rank in run_check("torch", tmp_path):
        run, even = rank["torch"], rank["rank"] % 2 == 0
        # right although completions were held back and released in opposite orders on even and odd
        # ranks, and on odd ranks steps 2 and 3 went out between the later buckets' hooks
        assert run["vs_plain"] <= 1e-5, rank["rank"]
        events = run["events"]
        calls = [i for i, e in enumerate(events) if e[0] == "hook"]
        returns = [i for i, e in enumerate(events) if e[0] == "returned"]
        assert len(calls) == len(returns) >= 4  # many buckets
        # each hook's future was pending when it returned (all held on even ranks, the first on odd)
        assert [events[i][2] for i in returns[:None if even else 1]] == [False] * (len(returns) if even else 1)
        # each hook issued step 1 (both halves: an all-to-all each), and nothing else issues it; steps 2
        # and 3 came from callbacks (on threads of their own: counted over the whole run)
        kinds = [e[1] if e[0] == "issue" else None for e in events]
        assert [kinds[call:end].count("all_to_all") for call, end in zip(calls, returns)] == [2] * len(calls)
        assert kinds.count("all_to_all") == kinds.count("all_reduce") == kinds.count("all_gather") == 2 * len(calls)
        opened = events.index(["open"])
        assert opened == returns[-1 if even else 0] + 1


def test_horovod_starts_each_bucket_during_backward_and_issues_the_same_there_on_every_rank(tmp_path):
    ranks = [rank["horovod"] for rank in run_check("horovod", tmp_path)]
    in_backward = [run["events"][:run["events"].index(["synchronize"])] for run in ranks]
    for r, run in enumerate(ranks):
        assert run["vs_plain"] <= 1e-5, r
        events = run["events"]
        last_ready = max(i for i, e in enumerate(events) if e[0] == "ready")
        issued = [(i, e[1], e[2]) for i, e in enumerate(events) if e[0] == "issue"]
        buckets = {bucket for _, _, bucket in issued}
        assert len(buckets) >= 3
        # every bucket's first step (both halves) went out during backward, the moment its last gradient
        # was ready (the optimizer's hook runs before the recording one on the same parameter)
        assert sorted(b for i, step, b in issued if step == "sum" and i < last_ready) == sorted([*buckets] * 2)
        # and nothing else: what a rank issues there must not depend on which steps have completed
        assert all(e[1] == "sum" for e in in_backward[r] if e[0] == "issue")
        assert in_backward[r] == in_backward[0], r  # although the stand-in's poll() answers differ


def test_horovod_runs_its_own_hierarchical_all_reduce_only_on_gpus_across_nodes_with_nccl_and_mpi():
    assert horovod_engine.horovod_hierarchical(nccl_built=2, mpi_enabled=True, device_type="cuda", nodes=2)
    assert not horovod_engine.horovod_hierarchical(0, True, "cuda", 2)  # no NCCL
    assert not horovod_engine.horovod_hierarchical(2, False, "cuda", 2)  # gloo: Horovod's is an MPI operation
    assert not horovod_engine.horovod_hierarchical(2, True, "cpu", 2)
    assert not horovod_engine.horovod_hierarchical(2, True, "cuda", 1)  # one node: Horovod ignores it


@pytest.mark.parametrize("allreduce, cuda, nccl, expected", [("hierarchical", True, 2, "1"),
                                                            ("hierarchical", False, 2, None),
                                                            ("hierarchical", True, 0, None),
                                                            ("torus", True, 2, None)])
def test_horovod_is_asked_for_its_hierarchical_all_reduce_before_init(allreduce, cuda, nccl, expected, monkeypatch):
    seen, variable = {}, "HOROVOD_HIERARCHICAL_ALLREDUCE"
    hvd = types.SimpleNamespace(nccl_built=lambda: nccl, rank=lambda: 0, size=lambda: 1, local_rank=lambda: 0,
                                allgather_object=lambda obj: [obj],
                                init=lambda: seen.setdefault("at_init", os.environ.get(variable)))
    stand_in_for_horovod(monkeypatch, hvd)
    # a copy without the variable; OMP_NUM_THREADS set, so that the engine leaves this process's threads alone
    environ = {k: v for k, v in os.environ.items() if k != variable}
    monkeypatch.setattr(os, "environ", {**environ, "OMP_NUM_THREADS": "1"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(horovod_engine, "local_device", lambda local_rank: torch.device("cpu"))
    horovod_engine.Horovod(Config(engine="horovod", allreduce=allreduce, ranks_per_node=1))
    assert seen == {"at_init": expected}


class SpinningHorovod:
    """Stands in for horovod.torch's waiting: an operation completes `after` seconds from its start;
    synchronize() spins until then (Horovod's wait is a yield in a loop) and poll() says whether it has."""

    def __init__(self, after: float):
        self.done_at, self.polls, self.synchronized = time.monotonic() + after, 0, 0

    def poll(self, handle) -> bool:
        self.polls += 1
        return time.monotonic() >= self.done_at

    def synchronize(self, handle):
        while time.monotonic() < self.done_at:
            pass
        self.synchronized += 1
        return handle


def test_horovod_waits_sleep_instead_of_taking_a_core_on_cpu():
    hvd = SpinningHorovod(after=0.3)
    start, cpu = time.monotonic(), time.thread_time()
    assert horovod_engine.horovod_result(hvd, "handle", torch.device("cpu")) == "handle"
    # waited the whole 0.3 s for the result, but slept through it (Horovod's own wait burns the core)
    assert time.monotonic() - start >= 0.3 and time.thread_time() - cpu < 0.1
    assert hvd.polls > 1 and hvd.synchronized == 1


def test_horovod_waits_are_horovods_own_on_a_gpu_host():
    hvd = SpinningHorovod(after=0.0)  # a GPU host has cores to spare: Horovod's wait as it is
    horovod_engine.horovod_result(hvd, "handle", torch.device("cuda"))
    assert (hvd.polls, hvd.synchronized) == (0, 1)
