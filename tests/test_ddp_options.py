"""The torch engine's DDP (train/engines/torch_distributed.py, docs/allreduce.md): its options by device
and settings (static_graph on GPUs), static_graph forced on in a real 2-rank torchrun run on gloo with
the flat all-reduce, the two-level hook and the fp16 wire (the same weights as without it), the step's
named ranges in a profiler trace, and a compile longer than TRAINER_COLLECTIVE_TIMEOUT_S inside the
step's wait that does not get a rank ended by the watchdog (train/engines/distributed.py); static_graph off
wherever the run accumulates gradients (a 2-rank run that asks for both trains), and 2 ranks accumulating 2
batches per step training as 4 ranks on the two-level all-reduce, on the fp32 and the fp16 wire."""
import inspect
import json

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from helpers import REPO, launch
from train.config import Config, ResolvedConfig
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


def test_static_graph_is_off_wherever_the_run_accumulates():
    """DDP's static_graph cannot be combined with no_sync, which the passes before a step's last run in."""
    def static_graph(device, **settings):
        return ddp_options(Config(batch_size=8, global_batch_size=16, **settings), device, ACCEPTED)["static_graph"]
    assert static_graph(CPU, ddp_static_graph="on", accumulation_steps=1) is True  # 2 ranks x 8 x 1
    assert static_graph(CPU, ddp_static_graph="on", accumulation_steps=2) is False  # 1 rank x 8 x 2
    assert static_graph(GPU, accumulation_steps=1) is True and static_graph(GPU, accumulation_steps=2) is False
    # a later --batch-schedule phase that accumulates (2 ranks, 64 per rank above the largest batch 16): off
    assert ddp_options(ResolvedConfig(batch_size=8, global_batch_size=16, accumulation_steps=1, largest_batch=16,
                           batch_schedule="1:128", ddp_static_graph="on"), CPU, ACCEPTED)["static_graph"] is False


@pytest.mark.multiprocess
def test_a_static_graph_run_that_accumulates_trains_on_two_ranks(tmp_path):
    """torchrun, 2 ranks, --ddp-static-graph on with 2 batches accumulated per step (start-up's choice for
    --batch-size 4 --global-batch-size 16): the run trains (DDP without static_graph) to the weights of the
    same run with --ddp-static-graph off."""
    flags = ["--loader", "synthetic", "--synthetic-images", 64, "--synthetic-val-images", 0, "--synthetic-classes", 10,
             "--arch", "resnet18", "--image-size", 16, "--batch-size", 4, "--global-batch-size", 16, "--max-steps", 2,
             "--epochs", 1, "--log-every", 1, "--threads", 1]
    for graph in ("on", "off"):
        done = launch("torch", 2, "-m", "train", "--out-dir", tmp_path / graph, "--ddp-static-graph", graph, *flags,
                      cwd=tmp_path, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        assert "2 rank(s) x batch 4 x 2 accumulated = global batch 16" in done.stdout, done.stdout
        assert ("warning: --ddp-static-graph on not taken" in done.stdout) == (graph == "on"), done.stdout
    on, off = (torch.load(tmp_path / graph / "checkpoint.pt", weights_only=True)["model"] for graph in ("on", "off"))
    assert on.keys() == off.keys() and all(torch.equal(on[key], off[key]) for key in on)


@pytest.mark.multiprocess
@pytest.mark.parametrize("wire, steps, tolerance", [([], 3, 1e-4)])
def test_two_ranks_accumulating_two_batches_train_as_four_ranks(tmp_path, wire, steps, tolerance):
    """torchrun, --allreduce hierarchical: 2 ranks (1 a node) x batch 4 x 2 accumulated and 4 ranks (2 a
    node) x batch 4 end with the same weights and BatchNorm statistics to rounding: after 3 LARS steps on
    the fp32 wire; after 1 on --fp16-allreduce's, whose rounding (about 1e-3 of a step) later steps grow."""
    flags = ["--loader", "synthetic", "--synthetic-images", 64, "--synthetic-val-images", 0, "--synthetic-classes", 10,
             "--arch", "resnet18", "--image-size", 16, "--batch-size", 4, "--max-steps", steps, "--epochs", 1,
             "--log-every", 1, "--threads", 1, "--allreduce", "hierarchical", *wire]
    for ranks, more in ((4, ["--ranks-per-node", 2]), (2, ["--ranks-per-node", 1, "--accumulation-steps", 2])):
        done = launch("torch", ranks, "-m", "train", "--out-dir", tmp_path / str(ranks), *flags, *more, cwd=tmp_path,
                      timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        assert "global batch 16" in done.stdout.splitlines()[0], done.stdout
    four, two = (torch.load(tmp_path / str(ranks) / "checkpoint.pt", weights_only=True)["model"] for ranks in (4, 2))
    assert four.keys() == two.keys()
    for key, tensor in four.items():  # (relative to the tensor's largest value: BatchNorm's biases are near 0)
        if tensor.is_floating_point():
            assert (two[key] - tensor).abs().max() <= tolerance * tensor.abs().max(), key
        else:
            assert torch.equal(two[key], tensor), key  # (batch counts: one per optimizer step on both)
