"""Horovod holds the run's optimizer instead of rebuilding it: every optimizer and its options train
under horovodrun as in one process; the step's named ranges; and on CUDA Horovod's asynchronous
completion, asked for before hvd.init()."""
import json
import os
import types

import pytest
import torch

from helpers import REPO, launch, stand_in_for_horovod
from train.config import Config
from train.engines import horovod as horovod_engine


@pytest.mark.multiprocess
def test_every_optimizer_and_option_steps_under_horovodrun_as_in_one_process(tmp_path):
    """tests/helpers/horovod_optimizers_check.py: each optimizer (lars, lars --lars-compile, sgd, sgd
    --nesterov, rmsprop-warmup), fp32 and fp16 loss scaling on --fp16-allreduce's wire, through the
    engine's wrap() and step() and, beside it, as one process steps it on gradients averaged by hand:
    the same weights, bit for bit (2 ranks: a sum of two numbers has one order)."""
    result = launch("horovod", 2, REPO / "tests" / "helpers" / "horovod_optimizers_check.py", tmp_path, cwd=tmp_path,
                    env={"TRAINER_ALLOW_CPU_FP16": "1", "OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        runs = rank["configurations"]
        assert len(runs) == 10
        for name, run in runs.items():
            assert run["moved"] == 62, name  # every tensor of resnet18 trained
            assert run["difference"] == 0, (name, run["difference"])
            assert run["loss_scales"][0] == run["loss_scales"][1], name
        # --lars-compile reached the optimizer that steps: its first configuration compiled (the second
        # finds the graph compiled), and nothing else compiles
        assert runs["lars-compile-fp32"]["compiled"]
        assert not any(run["compiled"] for name, run in runs.items() if not name.startswith("lars-compile"))
        # the step's parts, as a profiler trace names them
        assert rank["ranges"] == ["backward", "all-reduce", "optimizer"]


def horovod_stand_in(seen: dict, cuda_variable: str):
    return types.SimpleNamespace(nccl_built=lambda: 0, rank=lambda: 0, size=lambda: 1, local_rank=lambda: 0,
                                 local_size=lambda: 1, allgather_object=lambda obj: [obj],
                                 init=lambda: seen.setdefault("at_init", os.environ.get(cuda_variable)))


@pytest.mark.parametrize("cuda, elastic, set_before, expected", [(True, False, None, "1"),
                                                                 (False, False, None, None),
                                                                 (True, True, None, None),
                                                                 (True, False, "0", "0")])
def test_async_completion_is_asked_for_before_init_on_cuda_only(cuda, elastic, set_before, expected, monkeypatch):
    """HOROVOD_ENABLE_ASYNC_COMPLETION, read by hvd.init(): on a CUDA host, where synchronize() would
    otherwise hold the host until the GPU has summed; not on a CPU host (nothing to complete
    asynchronously), not under Horovod Elastic (Horovod sees NCCL's errors only while it waits), and a
    value the user set stays."""
    seen, variable = {}, "HOROVOD_ENABLE_ASYNC_COMPLETION"
    stand_in_for_horovod(monkeypatch, horovod_stand_in(seen, variable))
    environ = {k: v for k, v in os.environ.items() if k not in (variable, "HOROVOD_ELASTIC")}
    environ.update({"OMP_NUM_THREADS": "1"}, **({"HOROVOD_ELASTIC": "1"} if elastic else {}),
                   **({variable: set_before} if set_before else {}))
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    # a CUDA host, faked: the engine's device stays the CPU, which is all this process has
    monkeypatch.setattr(horovod_engine, "local_device", lambda local_rank: torch.device("cpu"))
    horovod_engine.Horovod(Config(engine="horovod", ranks_per_node=1))
    assert seen == {"at_init": expected}
