"""The torch engine's DDP (train/engines/torch_distributed.py, docs/allreduce.md): its options by device
and settings (static_graph on GPUs), static_graph forced on in a real 2-rank torchrun run on gloo with
the flat all-reduce, the two-level hook and the fp16 wire (the same weights as without it), the step's
named ranges in a profiler trace, and a compile longer than TRAINER_COLLECTIVE_TIMEOUT_S inside the
step's wait that does not get a rank ended by the watchdog (train/engines/topology.py)."""
import inspect
import json

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from helpers import REPO, launch
from train.config import Config
from train.engines.torch_distributed import ddp_options

ACCEPTED = inspect.signature(DistributedDataParallel).parameters
GPU, CPU = torch.device("cuda", 1), torch.device("cpu")


def test_static_graph_is_on_for_gpus_and_where_asked():
    on_gpu = ddp_options(Config(), GPU, ACCEPTED)
    assert on_gpu["static_graph"] is True and on_gpu["device_ids"] == [1] and on_gpu["gradient_as_bucket_view"]
    assert ddp_options(Config(), CPU, ACCEPTED)["static_graph"] is False
    assert ddp_options(Config(ddp_static_graph="on"), CPU, ACCEPTED)["static_graph"] is True
    assert ddp_options(Config(ddp_static_graph="off"), GPU, ACCEPTED)["static_graph"] is False
    assert ddp_options(Config(), CPU, ACCEPTED)["device_ids"] is None
    assert "bucket_cap_mb" not in on_gpu  # DDP's own: a 1 MiB first bucket, then 25 MiB
    # no broadcast of BatchNorm's buffers at every forward, in this torch's spelling of it
    assert on_gpu.get("forward_sync_buffers", on_gpu.get("broadcast_buffers")) is False
    if "init_sync" in ACCEPTED:
        assert ddp_options(Config(init_from_seed=True), GPU, ACCEPTED)["init_sync"] is False
        assert "init_sync" not in on_gpu


TIMEOUT_S = 6  # TRAINER_COLLECTIVE_TIMEOUT_S of the launch; the helper's backward compiles for twice that


@pytest.mark.multiprocess
def test_static_graph_trains_alike_on_every_all_reduce_and_a_long_compile_is_no_wait(tmp_path):
    """tests/helpers/static_graph_check.py on 2 ranks. Fails when static_graph does not reach DDP, when
    the step's ranges are not named, or when the backward's compile counts as a wait (the watchdog
    ends the rank: 'error: rank ... waited 6 s')."""
    done = launch("torch", 2, REPO / "tests" / "helpers" / "static_graph_check.py", tmp_path, cwd=tmp_path,
                  timeout=300, env={"TRAINER_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "error: rank" not in done.stderr
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert set(result["static_vs_not"]) == {"flat own", "flat fp16", "hierarchical own", "hierarchical fp16"}
        for case, differs in result["static_vs_not"].items():  # the same sums in the same order: to rounding
            assert differs <= 1e-6, (rank, case, differs)
        assert result["ranges"] == ["backward", "optimizer"], result
        assert result["compiled_steps_s"] > 2 * TIMEOUT_S  # (the compile did outlast the timeout)
