import copy

import pytest
import torch
import torchvision

from helpers import run_train
from helpers.host_reads import ScalarReads
from train.lars import LARS, decay_param_groups


def reference_lars_step(params, grads, buffers, lr, momentum, wd, eta, eps, exclude):
    """The docs/lars.md formula, one tensor at a time, in float64."""
    for p, g, m in zip(params, grads, buffers):
        if exclude:
            m.mul_(momentum).add_(lr * g)
        else:
            w_norm, g_norm = p.norm().item(), g.norm().item()
            trust = eta * w_norm / (g_norm + wd * w_norm + eps) if w_norm > 0 and g_norm > 0 else 1.0
            m.mul_(momentum).add_(lr * trust * (g + wd * p))
        p.sub_(m)


def make_tensors(seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(8, 4, 3, 3), (16, 8), (5,), (7, 3)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    params[3].zero_()  # a zero-norm weight: trust falls back to 1
    return params


@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_lars_matches_reference_formula(eps):
    lr_by_step = [0.5, 1.0, 2.0, 1.5]
    regular, excluded = make_tensors(0), make_tensors(1)[:2]
    params = [torch.nn.Parameter(t.clone()) for t in regular + excluded]
    opt = LARS([{"params": params[:4]}, {"params": params[4:], "lars_exclude": True}],
               lr=1.0, momentum=0.9, weight_decay=1e-4, eta=0.001, epsilon=eps)
    ref_regular = [t.double().clone() for t in regular]
    ref_excluded = [t.double().clone() for t in excluded]
    ref_buffers = [torch.zeros_like(t) for t in ref_regular + ref_excluded]
    gen = torch.Generator().manual_seed(2)
    for step, lr in enumerate(lr_by_step):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        grads[1].zero_()  # a zero-norm gradient: trust falls back to 1
        for p, g in zip(params, grads):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        reference_lars_step(ref_regular, [g.double() for g in grads[:4]], ref_buffers[:4], lr, 0.9, 1e-4, 0.001, eps, False)
        reference_lars_step(ref_excluded, [g.double() for g in grads[4:]], ref_buffers[4:], lr, 0.9, 1e-4, 0.001, eps, True)
        for got, want in zip(params, ref_regular + ref_excluded, strict=True):
            torch.testing.assert_close(got.detach().double(), want, rtol=1e-5, atol=1e-6)


def test_excluded_group_has_no_weight_decay_or_trust():
    w = torch.nn.Parameter(torch.full((4,), 3.0))
    opt = LARS([{"params": [w], "lars_exclude": True}], lr=0.1, momentum=0.9, weight_decay=0.5, eta=0.001)
    w.grad = torch.ones(4)
    opt.step()
    torch.testing.assert_close(w.detach(), torch.full((4,), 3.0 - 0.1))  # plain lr * g, no decay, no trust


def test_epsilon_zero_means_zero():
    # with eps 0 the trust ratio is exactly eta*||w||/(||g|| + wd*||w||); a hidden 1e-7 would show up here
    w = torch.nn.Parameter(torch.tensor([1e-6, 0.0], dtype=torch.float64))
    opt = LARS([w], lr=1.0, momentum=0.0, weight_decay=0.0, eta=1.0, epsilon=0.0)
    w.grad = torch.tensor([1e-6, 0.0], dtype=torch.float64)
    opt.step()
    # trust = 1e-6 / 1e-6 = 1, update = g
    torch.testing.assert_close(w.detach(), torch.tensor([0.0, 0.0], dtype=torch.float64), atol=1e-15, rtol=0)


def test_param_groups_exclude_every_batchnorm_parameter_and_bias():
    model = torchvision.models.resnet50()
    regular, excluded = decay_param_groups(model)
    bn_params = {id(p) for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in m.parameters()}
    biases = {id(p) for n, p in model.named_parameters() if n.endswith(".bias")}
    assert {id(p) for p in excluded["params"]} == bn_params | biases
    assert excluded["lars_exclude"] and not regular["lars_exclude"]
    assert all(p.dim() > 1 for p in regular["params"])
    assert len(regular["params"]) + len(excluded["params"]) == len(list(model.parameters()))



def test_step_never_reads_a_tensor_value_on_the_host():
    model = torchvision.models.resnet18(num_classes=10)
    opt = LARS(decay_param_groups(model), lr=1.0, weight_decay=5e-5)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    with ScalarReads() as mode:
        opt.step()
    assert mode.reads == 0


def test_state_dict_round_trip_continues_identically():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    x = torch.randn(4, 3, 32, 32)
    opt = LARS(decay_param_groups(model), lr=0.5, weight_decay=5e-5)
    model(x).sum().backward(); opt.step(); opt.zero_grad()
    twin = copy.deepcopy(model)
    twin_opt = LARS(decay_param_groups(twin), lr=0.5, weight_decay=5e-5)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as if read back from a file
    for m, o in ((model, opt), (twin, twin_opt)):
        m(x).sum().backward(); o.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)


def test_channels_last_weight_with_contiguous_gradient():
    # Horovod hands back contiguous gradients for channels_last weights; the update must not mix layouts
    torch.manual_seed(3)
    w = torch.randn(8, 4, 3, 3)
    p_cl = torch.nn.Parameter(w.clone().contiguous(memory_format=torch.channels_last))
    p_ref = torch.nn.Parameter(w.clone())
    opt_cl, opt_ref = (LARS([p], lr=1.0, momentum=0.9, weight_decay=1e-4) for p in (p_cl, p_ref))
    for _ in range(2):
        g = torch.randn(8, 4, 3, 3)
        p_cl.grad, p_ref.grad = g.clone(), g.clone()  # contiguous gradient for the channels_last weight
        opt_cl.step(); opt_ref.step()
    torch.testing.assert_close(p_cl.detach(), p_ref.detach(), rtol=0, atol=1e-7)


@pytest.mark.slow
def test_the_compiled_update_follows_the_reference_formula_and_leaves_the_eager_step_alone():
    """--lars-compile: the trust-ratio group through torch.compile (the excluded group stays eager),
    checked against the float64 formula over steps with changing LR (a 0-dim tensor: no recompile per
    value), a zero-norm weight and a zero-norm gradient, and a channels_last weight. No host read: the
    update compiles with fullgraph=True, where .item() or a branch on a tensor's value cannot compile
    (a dispatch mode, as above, would keep torch.compile from running at all)."""
    regular = make_tensors(0) + [torch.randn(8, 4, 3, 3).contiguous(memory_format=torch.channels_last)]
    params = [torch.nn.Parameter(t.clone()) for t in regular]
    opt = LARS([{"params": params}], lr=1.0, momentum=0.9, weight_decay=1e-4, eta=0.001, epsilon=1e-3, compiled=True)
    reference = [t.double().clone() for t in regular]
    buffers = [torch.zeros_like(t) for t in reference]
    gen = torch.Generator().manual_seed(2)
    for step, lr in enumerate((0.5, 1.0, 2.0)):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        grads[1].zero_()
        for p, g in zip(params, grads):
            p.grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = lr
        with torch._dynamo.config.patch(error_on_recompile=step > 0):  # a new LR is no new graph
            opt.step()
        reference_lars_step(reference, [g.double() for g in grads], buffers, lr, 0.9, 1e-4, 0.001, 1e-3, False)
        for got, want in zip(params, reference, strict=True):
            torch.testing.assert_close(got.detach().double(), want, rtol=1e-5, atol=1e-6)
        assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # the compiled update leaves .grad


@pytest.mark.slow
def test_a_run_with_lars_compile_trains_as_the_eager_one(tmp_path):
    """--lars-compile reaches the optimizer: the run ends where the eager run does, to rounding, and
    not exactly (the fused update rounds differently), so the compiled path did run."""
    base = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 32,
            "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 1, "--eval-every", 0, "--max-steps", 3]
    weights = {}
    for flags in ([], ["--lars-compile"]):
        out = f"run{len(flags)}"
        result = run_train("--out-dir", out, *base, *flags, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        weights[len(flags)] = torch.load(tmp_path / out / "checkpoint.pt", weights_only=True)["model"]
    eager, compiled = weights[0], weights[1]
    for key in eager:
        torch.testing.assert_close(compiled[key], eager[key], rtol=1e-4, atol=1e-5)
    assert not all(torch.equal(compiled[k], eager[k]) for k in eager)
    refused = run_train("--out-dir", "sgd", *base, "--lars-compile", "--optimizer", "sgd", cwd=tmp_path)
    assert refused.returncode == 2 and "--lars-compile needs --optimizer lars" in refused.stderr
