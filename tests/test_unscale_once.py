"""fp16 loss scaling unscales once (train/precision.py, docs/precision.md): Precision.step has the scaler
unscale the gradients and check them for inf/NaN in one fused pass, and the optimizers then skip on the
device with the flag alone. Left to GradScaler.step, the scaler would check in a pass of its own (at a
scale of 1) and the optimizer divide by the scale in another."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from train.lars import LARS, decay_param_groups
from train.optim import SGD, RMSpropWarmup, groups_with_weight_decay
from train.precision import Precision

CHECK_AND_UNSCALE = "aten._amp_foreach_non_finite_check_and_unscale_.default"


class _Settings:
    weight_decay = 1e-4


OPTIMIZERS = {
    "lars": lambda model: LARS(decay_param_groups(model), lr=0.5, momentum=0.9, weight_decay=1e-4),
    "sgd": lambda model: SGD(groups_with_weight_decay(_Settings, model), lr=0.1, momentum=0.9),
    "rmsprop-warmup": lambda model: RMSpropWarmup(groups_with_weight_decay(_Settings, model), lr=0.1, momentum=0.9,
                                                  rms_lr_ratio=0.01, sgd_share=0.3),
}


def _model(channels_last: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 4))
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _loss(model, generator, channels_last: bool = False):
    x, y = torch.randn(6, 3, 8, 8, generator=generator), torch.randint(0, 4, (6,), generator=generator)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return torch.nn.functional.cross_entropy(model(x), y)


class ScaleUses(TorchDispatchMode):
    """While entered, records each op that reads the gradients with the loss scale: the scaler's
    check-and-unscale, and any op given a 0-dim tensor holding the scale or its inverse, as
    (op, the values of its 0-dim tensor arguments)."""

    def __init__(self, gradients: list[torch.Tensor], scale: float):
        super().__init__()
        self.gradients = {g.data_ptr() for g in gradients}
        self.scale, self.uses = scale, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for a in list(args) + list(kwargs.values())
                   for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, torch.Tensor)]
        if any(t.data_ptr() in self.gradients for t in tensors):
            values = [t.item() for t in tensors if t.dim() == 0]
            if str(func) == CHECK_AND_UNSCALE or {self.scale, 1 / self.scale} & set(values):
                self.uses.append((str(func), values))
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_fp16_step_unscales_and_checks_the_gradients_in_one_pass(name, monkeypatch):
    monkeypatch.setenv("TRAINER_ALLOW_CPU_FP16", "1")
    model = _model()
    optimizer = OPTIMIZERS[name](model)
    precision = Precision("fp16", torch.device("cpu"))
    scale = precision.scaler.get_scale()
    precision.backward(_loss(model, torch.Generator().manual_seed(1)))
    with ScaleUses([p.grad for p in model.parameters()], scale) as recorded:
        precision.step(optimizer)
    # one pass: the fused check that multiplies by 1/scale (found_inf 0), and nothing else with the scale
    assert recorded.uses == [(CHECK_AND_UNSCALE, [0.0, 1 / scale])]


@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels_last"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_fp16_step_skips_on_the_device_as_the_scaler_would(name, channels_last, monkeypatch):
    """Precision.step (unscaled first, then the optimizer given the flag alone) against the same
    optimizer left to GradScaler's host-side skip: the same weights, optimizer state and scale after
    normal steps and after an overflowing one, which changes nothing at all."""
    monkeypatch.setenv("TRAINER_ALLOW_CPU_FP16", "1")
    runs = []
    for on_device in (True, False):
        model = _model(channels_last)
        optimizer = OPTIMIZERS[name](model)
        if not on_device:
            optimizer._step_supports_amp_scaling = False  # the scaler reads found_inf and skips step() itself
        precision = Precision("fp16", torch.device("cpu"))
        generator = torch.Generator().manual_seed(1)
        history = []
        for step in range(4):
            loss = _loss(model, generator, channels_last)
            precision.backward(loss * (float("inf") if step == 1 else 1.0))
            before = [t.clone() for t in _everything(model, optimizer)]
            precision.step(optimizer)
            optimizer.zero_grad()
            after = _everything(model, optimizer)
            if step == 1:  # the overflowing step
                assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
            else:
                assert not all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            history.append(([t.clone() for t in after], precision.scaler.get_scale()))
        runs.append(history)
    on_device, by_scaler = runs
    assert [scale for _, scale in on_device] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15]
    for (mine, my_scale), (theirs, their_scale) in zip(on_device, by_scaler, strict=True):
        assert my_scale == their_scale
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _everything(model, optimizer) -> list[torch.Tensor]:
    """The weights and every tensor of the optimizer's state."""
    state = [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [p.detach() for p in model.parameters()] + state
