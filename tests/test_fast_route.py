"""The optimizer step's multi-tensor calls take CUDA's multi-tensor fast route (docs/lars.md, "Kernels").

On CUDA a torch._foreach_* call launches one kernel for a whole tensor list only when its arguments
allow it (torch's ATen/native/ForeachUtils.h, `can_use_fast_route`); otherwise it falls back to one
kernel per tensor, silently. A CPU has no fast route to fall back from, so the arguments are checked
instead, at the dispatcher: each tensor list strided, non-overlapping and dense, all on one device in
one dtype; paired lists equal in shape and in strides (dimensions of size 1 aside); anything else a
Python scalar, a list of them, or one 0-dim tensor on the lists' device. And the step makes the same
calls whatever the number of tensors: nothing per tensor.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.lars import LARS, decay_param_groups
from train.optim import SGD, RMSpropWarmup, groups_with_weight_decay
from train.precision import Precision

MULTI_TENSOR = ("_foreach_", "_fused_", "_amp_foreach_")  # the aten ops that walk tensor lists


class _Settings:
    weight_decay = 5e-5


OPTIMIZERS = {
    "lars": lambda model: LARS(decay_param_groups(model), lr=2.0, momentum=0.9, weight_decay=5e-5),
    "sgd": lambda model: SGD(groups_with_weight_decay(_Settings, model), lr=0.1, momentum=0.9, nesterov=True),
    "rmsprop-warmup": lambda model: RMSpropWarmup(groups_with_weight_decay(_Settings, model), lr=0.1, momentum=0.9,
                                                  rms_lr_ratio=0.01, sgd_share=0.3),
}


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill a block of memory once each, in some order of its dimensions (as torch's
    is_non_overlapping_and_dense: dimensions of size 1 do not count)."""
    filled = 1
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride != filled:
            return False
        filled *= size
    return True


def fast_route_problem(args: tuple, kwargs: dict) -> str | None:
    """Why CUDA would take a multi-tensor call with these arguments off its fast route, or None."""
    values = list(args) + list(kwargs.values())
    lists = [v for v in values if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v)]
    if not lists:
        return "no tensor list"
    first = lists[0][0]
    for tensors in lists:
        for t in tensors:
            if t.device != first.device or t.dtype != first.dtype:
                return f"{t.dtype} on {t.device} beside {first.dtype} on {first.device}"
            if t.layout != torch.strided or not non_overlapping_and_dense(t):
                return f"a tensor of strides {t.stride()} for size {tuple(t.shape)}: not dense"
    for other in lists[1:]:
        for a, b in zip(lists[0], other, strict=True):
            if a.shape != b.shape:
                return f"sizes {tuple(a.shape)} and {tuple(b.shape)} paired"
            if any(n > 1 and x != y for n, x, y in zip(a.shape, a.stride(), b.stride())):
                return f"strides {a.stride()} and {b.stride()} paired for size {tuple(a.shape)}"
    for v in values:
        if isinstance(v, torch.Tensor):  # one tensor: a 0-dim scalar on the device (fused kernels: a float flag)
            if v.dim() != 0 or v.device != first.device or v.dtype not in (first.dtype, torch.float32):
                return f"a {v.dim()}-dim {v.dtype} tensor on {v.device} beside the lists"
    return None


class MultiTensorCalls(TorchDispatchMode):
    """While entered, records each multi-tensor call (its overload, and what would take it off CUDA's
    fast route or None) and the kernels of everything else (ops that are no views)."""

    def __init__(self):
        super().__init__()
        self.calls, self.kernels = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if func.overloadpacket.__name__.startswith(MULTI_TENSOR):
            self.calls.append((name, fast_route_problem(args, kwargs)))
        elif not func.is_view and func.namespace == "aten":
            self.kernels.append(name)
        return func(*args, **kwargs)


def _model(blocks: int) -> torch.nn.Module:
    """A small ResNet-like stack: a 3x3 stem, `blocks` blocks of a 1x1 and a 3x3 convolution (with a
    bias) each followed by BatchNorm, and a linear head: 6 + 6 * blocks tensors in the two groups."""
    layers = [torch.nn.Conv2d(3, 8, 3, padding=1, bias=False), torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    for _ in range(blocks):
        layers += [torch.nn.Conv2d(8, 16, 1, bias=False), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                   torch.nn.Conv2d(16, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 10))


def _recorded_step(blocks: int, optimizer_name: str, precision_name: str, channels_last: bool) -> MultiTensorCalls:
    """A model's second optimizer step (the first makes the state), through Precision.step as the
    engines take it, recorded."""
    torch.manual_seed(0)
    model = _model(blocks)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    optimizer = OPTIMIZERS[optimizer_name](model)
    precision = Precision(precision_name, torch.device("cpu"))
    x = torch.randn(2, 3, 16, 16)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    for _ in range(2):
        optimizer.zero_grad()
        precision.backward(torch.nn.functional.cross_entropy(model(x), torch.tensor([1, 7])))
        with MultiTensorCalls() as recorded:
            precision.step(optimizer)
    return recorded


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("precision_name", ["fp32", "fp16"])
@pytest.mark.parametrize("optimizer_name", OPTIMIZERS)
def test_every_multi_tensor_call_of_the_step_takes_the_fast_route(optimizer_name, precision_name, channels_last,
                                                                   monkeypatch):
    """Both param groups (weights; BatchNorm parameters and biases), fp32 and fp16 loss scaling (the
    scaler's unscale and inf check are in the step), contiguous and channels_last weights: every
    multi-tensor call has fast-route arguments, and a model of 36 tensors steps with exactly the calls
    and kernels of one of 12."""
    monkeypatch.setenv("TRAINER_ALLOW_CPU_FP16", "1")
    small, large = (_recorded_step(blocks, optimizer_name, precision_name, channels_last) for blocks in (1, 5))
    assert small.calls, "no multi-tensor call recorded"
    assert [(name, problem) for name, problem in small.calls + large.calls if problem] == []
    assert large.calls == small.calls
    assert large.kernels == small.kernels


def test_the_check_sees_what_leaves_the_fast_route():
    """The argument check itself, on forms CUDA's dispatch sends to its per-tensor fallback."""
    weights = [torch.randn(8, 4, 3, 3), torch.randn(10, 8)]
    channels_last = [weights[0].contiguous(memory_format=torch.channels_last), weights[1]]
    scalars = [torch.tensor(0.5), torch.tensor(2.0)]
    assert fast_route_problem((weights, scalars), {}).startswith("sizes (8, 4, 3, 3) and () paired")
    assert fast_route_problem((weights, channels_last), {}).startswith("strides")
    assert fast_route_problem((weights, [w.double() for w in weights]), {}).startswith("torch.float64")
    assert fast_route_problem((weights, [weights[0][:, :2], weights[1]]), {}).endswith("not dense")
    assert fast_route_problem((weights, torch.ones(2)), {}).startswith("a 1-dim")
    # what the fast route takes: equal layouts (a size-1 dimension's stride aside), scalars, one 0-dim tensor
    pointwise = [torch.randn(16, 8, 1, 1), weights[1]]
    assert fast_route_problem((pointwise, [pointwise[0].contiguous(memory_format=torch.channels_last), weights[1]]),
                              {}) is None
    assert fast_route_problem((weights, [w.clone() for w in weights]), {"alpha": 0.5}) is None
    assert fast_route_problem((weights, [0.5, 2.0]), {}) is None
    assert fast_route_problem((weights, torch.tensor(0.5)), {}) is None
