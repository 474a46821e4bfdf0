"""Ghost BatchNorm (--bn-group-size G): statistics over groups of G images of a rank's batch,
against plain BatchNorm2d in training mode; a span of ranks (--bn-span) in one process, ranks as
threads, and across 2 ranks under torchrun. The fused path per device (models/batchnorm.py): the CPU
kernels here, the CUDA chain here too with stand-ins for its CUDA-only kernels, and on a GPU (marked
gpu) the real CUDA kernels against the CPU path."""
import contextlib
import copy
import json
import threading

import pytest
import torch

import models.batchnorm as batchnorm
from helpers import REPO, launch
from helpers.host_reads import ScalarReads
from models.batchnorm import GroupBatchNorm2d, convert_batchnorm
from train.config import Config
from train.engines.single import SingleProcess

C = 3


def plain_bn() -> torch.nn.BatchNorm2d:
    torch.manual_seed(1)
    bn = torch.nn.BatchNorm2d(C)
    with torch.no_grad():  # not the identity affine, and running statistics away from the defaults
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    return bn


def ghost(bn: torch.nn.BatchNorm2d, size: int) -> GroupBatchNorm2d:
    return convert_batchnorm(torch.nn.Sequential(copy.deepcopy(bn)), None, 1, size)[0]


def batch(n: int):
    generator = torch.Generator().manual_seed(2)
    images = (torch.randn(n, C, 5, 4, generator=generator) * 3 + 1).contiguous(memory_format=torch.channels_last)
    return images, torch.randn(n, C, 5, 4, generator=generator)


def forward_backward(module, images, weights):
    """Output, input gradient, and the module's weight/bias gradients, for loss sum(out * weights)."""
    module.train()
    x = images.clone().requires_grad_()
    out = module(x)
    (out * weights).sum().backward()
    return out.detach(), x.grad, module.weight.grad.clone(), module.bias.grad.clone()


def biggest(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def test_ghost_group_of_the_whole_batch_is_plain_batchnorm():
    bn, (images, weights) = plain_bn(), batch(8)
    module = ghost(bn, 8)
    ours, plain = forward_backward(module, images, weights), forward_backward(bn, images, weights)
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), ours, plain):
        assert biggest(a, b) <= 1e-5, name
    assert biggest(module.running_mean, bn.running_mean) <= 1e-5
    assert biggest(module.running_var, bn.running_var) <= 1e-5
    assert module.num_batches_tracked.item() == bn.num_batches_tracked.item() == 1
    assert ours[0].is_contiguous(memory_format=torch.channels_last)  # the input's memory format is kept
    assert list(module.state_dict()) == list(bn.state_dict())  # torchvision's parameters and buffers


def test_a_ghost_group_larger_than_the_batch_is_the_whole_batch():
    bn, (images, weights) = plain_bn(), batch(4)
    assert biggest(forward_backward(ghost(bn, 16), images, weights)[0], forward_backward(bn, images, weights)[0]) <= 1e-5


def test_ghost_groups_of_half_the_batch_are_two_plain_batchnorm_passes():
    bn, (images, weights) = plain_bn(), batch(8)
    module = ghost(bn, 4)
    out, grad, _, _ = forward_backward(module, images, weights)
    halves = [copy.deepcopy(bn) for _ in range(2)]
    passes = [forward_backward(half, images[i * 4:(i + 1) * 4], weights[i * 4:(i + 1) * 4])
              for i, half in enumerate(halves)]
    assert biggest(out, torch.cat([p[0] for p in passes])) <= 1e-5
    assert biggest(grad, torch.cat([p[1] for p in passes])) <= 1e-5
    # as documented: the running statistics move to the mean of the groups' statistics, i.e. they
    # equal the mean of the two passes' updates
    assert biggest(module.running_mean, (halves[0].running_mean + halves[1].running_mean) / 2) <= 1e-5
    assert biggest(module.running_var, (halves[0].running_var + halves[1].running_var) / 2) <= 1e-5
    whole = forward_backward(copy.deepcopy(bn), images, weights)[0]
    assert biggest(out, whole) > 1e-2  # the groups' statistics do differ from the whole batch's


def test_a_batch_that_the_groups_do_not_divide_raises():
    with pytest.raises(ValueError, match="a batch of 6 images does not split into groups of 4"):
        ghost(plain_bn(), 4)(batch(6)[0])


def test_evaluation_uses_the_running_statistics():
    bn, images = plain_bn(), batch(4)[0]
    module = ghost(bn, 2).eval()
    assert torch.equal(module(images), bn.eval()(images))


def test_without_span_and_ghost_groups_the_model_stays_plain_batchnorm():
    engine, model = SingleProcess(Config()), torch.nn.Sequential(plain_bn())
    assert engine.sync_batchnorm(model, 1) is model and type(model[0]) is torch.nn.BatchNorm2d
    assert engine.sync_batchnorm(model, 1, 0) is model and type(model[0]) is torch.nn.BatchNorm2d
    converted = engine.sync_batchnorm(model, 1, 2)[0]
    assert isinstance(converted, GroupBatchNorm2d) and converted.ghost == 2


@pytest.mark.multiprocess
def test_ghost_groups_across_two_ranks_are_plain_batchnorm_over_group_i_of_both(tmp_path):
    result = launch("torch", 2, REPO / "tests" / "helpers" / "ghost_bn_check.py", tmp_path, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for r in (0, 1):
        rank = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rank["converted"] == "GroupBatchNorm2d" and rank["channels_last"] and rank["span_1_untouched"]
        assert rank["output"] <= 1e-5 and rank["input_grad"] <= 1e-5, rank
        assert rank["running_mean"] <= 1e-5 and rank["running_var"] <= 1e-5, rank
        assert rank["without_span"] > 1e-2  # the other rank's images do count


# The fused path: each ghost group against BatchNorm2d alone on that group, both kernel sets ----------

def c(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(1, -1, 1, 1)


class CudaStandIns:
    """SyncBatchNorm's CUDA-only kernels written out on the CPU from what they compute (fp32 math,
    the input's dtype out), checking the arguments the kernels require; with `cuda_chain` the CUDA
    path of models/batchnorm.py runs on them, so its chaining is tested without a GPU."""

    @staticmethod
    def batch_norm_stats(x, eps):
        var, mean = torch.var_mean(x.float(), dim=(0, 2, 3), correction=0)
        return mean, torch.rsqrt(var + eps)

    @staticmethod
    def batch_norm_elemt(x, weight, bias, mean, invstd, eps, *, out):
        assert mean.dtype == invstd.dtype == torch.float32 and mean.is_contiguous() and invstd.is_contiguous()
        assert out.dtype == x.dtype and out.stride() == x.stride()  # written in place: same layout
        return out.copy_((x.float() - c(mean)) * c(invstd) * c(weight) + c(bias))

    @staticmethod
    def batch_norm_backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
        assert mean.dtype == invstd.dtype == torch.float32
        sum_dy = dy.float().sum(dim=(0, 2, 3))
        sum_dy_xmu = (dy.float() * (x.float() - c(mean))).sum(dim=(0, 2, 3))
        return (sum_dy if input_g else None, sum_dy_xmu if input_g else None,
                sum_dy_xmu * invstd if weight_g else None, sum_dy if bias_g else None)

    @staticmethod
    def batch_norm_backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
        assert count.dtype == torch.int32 and mean.dtype == invstd.dtype == sum_dy.dtype == torch.float32
        n = count.sum().float()  # every rank's count: the kernel divides by their sum
        grad = (dy.float() - c(sum_dy) / n - (x.float() - c(mean)) * c(invstd) ** 2 * c(sum_dy_xmu) / n) * c(invstd)
        return (grad * c(weight)).to(dy.dtype)


@pytest.fixture(params=["cpu kernels", "cuda chain"])
def kernels(request, monkeypatch):
    """Which of models/batchnorm.py's kernel sets runs: the CPU one, or the CUDA one on stand-ins."""
    if request.param == "cuda chain":
        for name in ("batch_norm_stats", "batch_norm_elemt", "batch_norm_backward_reduce", "batch_norm_backward_elemt"):
            monkeypatch.setattr(torch, name, getattr(CudaStandIns, name))
        monkeypatch.setattr(batchnorm, "_kernels", lambda x: batchnorm._CudaKernels)
    return request.param


def precision_context(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def run_in(module, images, weights, precision: str):
    """forward_backward under `precision` (bf16: autocast, with the images already bf16 as a
    convolution's output would be)."""
    with precision_context(precision):
        return forward_backward(module, images.to(torch.bfloat16) if precision == "bf16" else images, weights)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_each_ghost_group_is_batchnorm2d_on_that_group_alone(kernels, precision, memory_format):
    bn, (images, weights) = plain_bn(), batch(12)
    images = images.contiguous(memory_format=memory_format)
    module = ghost(bn, 4)  # three groups
    out, grad, grad_weight, grad_bias = run_in(module, images, weights, precision)
    alone = [copy.deepcopy(bn) for _ in range(3)]
    passes = [run_in(one, images[i * 4:(i + 1) * 4], weights[i * 4:(i + 1) * 4], precision)
              for i, one in enumerate(alone)]
    tolerance = 1e-2 if precision == "bf16" else 1e-5  # (bf16: an ulp of the rounded output is 4e-3)
    assert out.dtype == images.dtype if precision == "fp32" else out.dtype == torch.bfloat16
    assert out.is_contiguous(memory_format=memory_format) and grad.is_contiguous(memory_format=memory_format)
    assert grad.dtype == out.dtype
    assert biggest(out.float(), torch.cat([p[0] for p in passes]).float()) <= tolerance
    assert biggest(grad.float(), torch.cat([p[1] for p in passes]).float()) <= tolerance
    assert biggest(grad_weight, sum(p[2] for p in passes)) <= tolerance
    assert biggest(grad_bias, sum(p[3] for p in passes)) <= tolerance
    for name in ("running_mean", "running_var"):  # the mean of the groups' updates (statistics in fp32)
        assert biggest(getattr(module, name), sum(getattr(one, name) for one in alone) / 3) <= 1e-5, name


class ThreadSpan:
    """A BatchNorm span of ranks as threads of this process: rank r's all-reduce returns the sum of
    the tensors every rank passed in its call of the same number, and is recorded."""

    def __init__(self, ranks: int):
        self.barrier = threading.Barrier(ranks, timeout=60)
        self.slots = [None] * ranks
        self.calls = [[] for _ in range(ranks)]  # per rank: (shape, requires_grad) of each call

    def all_reduce(self, rank: int):
        def call(tensor: torch.Tensor) -> torch.Tensor:
            self.calls[rank].append((tuple(tensor.shape), tensor.requires_grad))
            self.slots[rank] = tensor.detach().clone()
            self.barrier.wait()
            total = sum(self.slots)  # the same order on every rank: the same rounding
            self.barrier.wait()  # (no rank writes its next call's slot before all have read this one)
            return total
        return call

    def run(self, work) -> list:
        """work(rank) on a thread per rank; their results in rank order; a failure re-raised here."""
        results, errors = [None] * len(self.slots), []

        def target(rank):
            try:
                results[rank] = work(rank)
            except BaseException as err:  # (a broken barrier wakes the other ranks)
                errors.append(err)
                self.barrier.abort()
        threads = [threading.Thread(target=target, args=(rank,)) for rank in range(len(self.slots))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results


def rank_batch(rank: int):
    generator = torch.Generator().manual_seed(10 + rank)
    images = torch.randn(4, C, 5, 4, generator=generator) * (1 + rank) + rank  # the ranks differ
    return images.contiguous(memory_format=torch.channels_last), torch.randn(4, C, 5, 4, generator=generator)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_span_of_two_ranks_is_batchnorm2d_over_group_i_of_both_with_one_all_reduce_each_way(kernels, precision):
    bn, span = plain_bn(), ThreadSpan(2)

    def rank_step(rank):
        module = convert_batchnorm(torch.nn.Sequential(copy.deepcopy(bn)), span.all_reduce(rank), 2, 2)[0]
        return run_in(module, *rank_batch(rank), precision), module

    ours = span.run(rank_step)
    batches, groups = [rank_batch(0), rank_batch(1)], [copy.deepcopy(bn) for _ in range(2)]
    tolerance = 1e-2 if precision == "bf16" else 1e-5
    reference_weight_grad = reference_bias_grad = 0
    for i, one in enumerate(groups):  # group i: images 2i, 2i+1 of each rank, as one batch of 4
        rows = slice(2 * i, 2 * i + 2)
        out, grad, grad_weight, grad_bias = run_in(one, torch.cat([b[0][rows] for b in batches]),
                                                   torch.cat([b[1][rows] for b in batches]), precision)
        reference_weight_grad, reference_bias_grad = reference_weight_grad + grad_weight, reference_bias_grad + grad_bias
        for rank in (0, 1):
            (rank_out, rank_grad, _, _), module = ours[rank]
            assert biggest(rank_out[rows].float(), out[2 * rank:2 * rank + 2].float()) <= tolerance
            assert biggest(rank_grad[rows].float(), grad[2 * rank:2 * rank + 2].float()) <= tolerance
            assert rank_out.is_contiguous(memory_format=torch.channels_last)
    # weight and bias gradients: each rank its own images' (the engine averages them over the ranks)
    assert biggest(ours[0][0][2] + ours[1][0][2], reference_weight_grad) <= tolerance
    assert biggest(ours[0][0][3] + ours[1][0][3], reference_bias_grad) <= tolerance
    assert biggest(ours[0][0][3], ours[1][0][3]) > 1e-2  # (not the span's sum on every rank)
    for name in ("running_mean", "running_var"):  # every rank: the mean of the groups' updates
        expected = sum(getattr(one, name) for one in groups) / 2
        for rank in (0, 1):
            assert biggest(getattr(ours[rank][1], name), expected) <= 1e-5, (name, rank)
    for rank in (0, 1):  # one all-reduce forward, one backward, both for all the groups, outside autograd
        assert span.calls[rank] == [((2, 2 * C), False), ((2, 2 * C), False)]



def test_a_training_step_makes_one_all_reduce_per_layer_each_way_and_no_host_read(kernels):
    calls = []

    def all_reduce(tensor):  # a span of one rank, recorded
        calls.append((tuple(tensor.shape), tensor.requires_grad))
        return tensor.clone()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
                                torch.nn.Conv2d(4, 6, 3), torch.nn.BatchNorm2d(6)).to(memory_format=torch.channels_last)
    model = convert_batchnorm(model, all_reduce, 1, 2)
    images = torch.randn(8, 3, 9, 9).contiguous(memory_format=torch.channels_last)
    with ScalarReads() as mode:
        model(images).square().sum().backward()
    assert mode.reads == 0
    # forward: layer 1 then 2; backward: 2 then 1; each [groups, 2C] for all 4 groups at once, no autograd
    assert calls == [((4, 8), False), ((4, 12), False), ((4, 12), False), ((4, 8), False)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
def test_the_cuda_kernels_give_the_cpu_path_numbers(precision, memory_format):
    """SyncBatchNorm's kernels in models/batchnorm.py's CUDA path against its CPU path (the twin of
    the CPU tests above: each checked there against BatchNorm2d): outputs, gradients, running
    statistics, dtype and layout, with ghost groups and a recorded 1-rank span all-reduce."""
    results = {}
    for device in ("cpu", "cuda"):
        calls = []

        def all_reduce(tensor):
            calls.append(tuple(tensor.shape))
            return tensor.clone()

        bn = convert_batchnorm(torch.nn.Sequential(plain_bn()), all_reduce, 1, 4)[0].to(device)
        images, weights = batch(12)
        images = images.to(device).contiguous(memory_format=memory_format)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16"):
            got = forward_backward(bn, images.to(torch.bfloat16) if precision == "bf16" else images, weights.to(device))
        results[device] = [t.cpu() for t in got] + [bn.running_mean.cpu(), bn.running_var.cpu()]
        assert got[0].is_contiguous(memory_format=memory_format) and got[1].is_contiguous(memory_format=memory_format)
        assert calls == [(3, 2 * C), (3, 2 * C)]
    tolerance = 1e-2 if precision == "bf16" else 1e-5
    for name, on_cuda, on_cpu in zip(("output", "input grad", "weight grad", "bias grad", "running mean",
                                      "running var"), results["cuda"], results["cpu"]):
        assert on_cuda.dtype == on_cpu.dtype, name
        assert biggest(on_cuda.float(), on_cpu.float()) <= tolerance, name
