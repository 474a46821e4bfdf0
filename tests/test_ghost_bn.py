"""Ghost BatchNorm (--bn-group-size G): statistics over groups of G images of a rank's batch,
against plain BatchNorm2d in training mode; across 2 ranks with --bn-span 2 under torchrun."""
import copy
import json

import pytest
import torch

from helpers import REPO, launch
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
