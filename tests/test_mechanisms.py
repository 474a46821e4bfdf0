"""The recipe mechanisms on CPU: the RMSprop-to-SGD blend, BatchNorm statistics recomputed over the
last batches, batch-size control (every image once per epoch, bit-exact resume across a change,
logged), augmentation switched off by the schedule, and every seed preset running a few steps."""
import json

import pytest
import torch

from helpers import REPO, compliance, launch, read_metrics, run_train
from data.sharding import TrainBatchSampler
from train.bnstats import recompute_bn_statistics
from train.engines.single import SingleProcess
from train.config import Config
from train.optim import RMSpropWarmup
from train.precision import Precision


def trained(make_optimizer, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))
    optimizer = make_optimizer(model.parameters())
    data = torch.randn(steps, 8, 6, generator=torch.Generator().manual_seed(1))
    for x in data:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("ratio", [1.0, 0.01])
def test_the_blend_at_share_0_is_rmsprop_and_at_share_1_momentum_sgd(ratio):
    settings = dict(momentum=0.9, weight_decay=1e-3)
    rms = trained(lambda p: torch.optim.RMSprop(p, lr=0.05 * ratio, alpha=0.9, eps=1e-6, **settings))
    blend_rms = trained(lambda p: RMSpropWarmup(p, lr=0.05, alpha=0.9, eps=1e-6, rms_lr_ratio=ratio, sgd_share=0.0,
                                                **settings))
    sgd = trained(lambda p: torch.optim.SGD(p, lr=0.05, **settings))
    blend_sgd = trained(lambda p: RMSpropWarmup(p, lr=0.05, alpha=0.9, eps=1e-6, rms_lr_ratio=ratio, sgd_share=1.0,
                                                **settings))
    assert torch.allclose(blend_rms, rms, rtol=1e-5, atol=1e-7) and torch.allclose(blend_sgd, sgd, rtol=1e-5, atol=1e-7)
    half = trained(lambda p: RMSpropWarmup(p, lr=0.05, alpha=0.9, eps=1e-6, rms_lr_ratio=ratio, sgd_share=0.5,
                                           **settings))
    assert not torch.allclose(half, rms) and not torch.allclose(half, sgd)


def test_recomputed_bn_statistics_are_those_of_the_last_batches_together():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
    batches = [torch.randn(5, 3, 8, 8) * 2 + 1, torch.randn(3, 3, 8, 8) - 1]
    engine = SingleProcess(Config())
    assert recompute_bn_statistics(model, batches, engine, Precision("fp32", engine.device)) == 8
    features = model[0](torch.cat(batches)).detach().transpose(0, 1).reshape(4, -1)
    assert torch.allclose(model[1].running_mean, features.mean(1), atol=1e-6)
    assert torch.allclose(model[1].running_var, features.var(1), rtol=1e-5)  # unbiased, as BatchNorm keeps it
    assert recompute_bn_statistics(model, [], engine, Precision("fp32", engine.device)) == 0


def _two_bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.BatchNorm2d(6), torch.nn.ReLU(),
                               torch.nn.Conv2d(6, 6, 3, padding=1), torch.nn.BatchNorm2d(6))


def _bn_inputs(model, batches, precision) -> list[torch.Tensor]:
    """Each BN layer's inputs over `batches` (a forward pass in training mode), concatenated."""
    layers = [m for m in model if isinstance(m, torch.nn.BatchNorm2d)]
    seen = {m: [] for m in layers}
    hooks = [m.register_forward_pre_hook(lambda m, args: seen[m].append(args[0].detach().clone())) for m in layers]
    with torch.no_grad(), precision.autocast():
        for batch in batches:
            model.train()(batch)
    for hook in hooks:
        hook.remove()
    return [torch.cat(seen[m]) for m in layers]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_recomputed_bn_statistics_equal_an_fp64_reference(precision):
    """Batches of 5, 3 and 7 images whose channels sit far from zero (mean 1000, std 1: where sums of
    squares cancel): each layer's mean and unbiased variance as fp64 takes them over the same inputs
    (bf16: the layer's bf16 inputs, read exactly)."""
    generator = torch.Generator().manual_seed(4)
    batches = [torch.randn(n, 3, 10, 10, generator=generator) for n in (5, 3, 7)]
    model, engine = _two_bn_model(), SingleProcess(Config())
    with torch.no_grad():
        model[0].bias.fill_(1000.0)
    mode = Precision(precision, engine.device)
    reference_model = _two_bn_model()
    reference_model.load_state_dict(model.state_dict())
    inputs = _bn_inputs(reference_model, batches, mode)
    assert recompute_bn_statistics(model, batches, engine, mode) == 15
    for layer, x in zip([model[1], model[4]], inputs):
        flat = x.double().transpose(0, 1).reshape(x.shape[1], -1)
        torch.testing.assert_close(layer.running_mean.double(), flat.mean(1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(layer.running_var.double(), flat.var(1), rtol=1e-5, atol=1e-6)
    assert inputs[0].mean() > 900 and inputs[0].dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)


def test_the_bn_recomputation_makes_no_fp64_activation_and_one_transfer(monkeypatch):
    """Every tensor the recomputation makes, seen at the dispatcher: none in fp64 is as large as a BN
    layer's input (fp64 only for per-channel vectors); and the host sends it one tensor of counts
    through to_device, whatever the number of layers, and makes no other transfer."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from helpers.transfers import counting_transfers
    from train import bnstats

    class Made(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.fp64_sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.fp64_sizes += [t.numel() for t in torch.utils._pytree.tree_leaves(out)
                                if isinstance(t, torch.Tensor) and t.dtype == torch.float64]
            return out

    generator = torch.Generator().manual_seed(5)
    batches = [torch.randn(n, 3, 10, 10, generator=generator) for n in (4, 6)]
    model, engine = _two_bn_model(), SingleProcess(Config())
    smallest_activation = min(x.numel() for x in _bn_inputs(_two_bn_model(), batches[:1], Precision("fp32", engine.device)))
    sent, to_device = [], bnstats.to_device
    monkeypatch.setattr(bnstats, "to_device", lambda tensor, device: sent.append(tensor.numel()) or to_device(tensor, device))
    with Made() as made, counting_transfers() as transfers:
        recompute_bn_statistics(model, batches, engine, Precision("fp32", engine.device))
    assert made.fp64_sizes and max(made.fp64_sizes) < smallest_activation, (max(made.fp64_sizes), smallest_activation)
    assert not transfers, transfers
    assert sent == [2 + 1]  # one tensor: each layer's value count, and the images


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["torch", "horovod"])
def test_recomputed_bn_statistics_span_all_ranks(launcher, tmp_path):
    out = tmp_path / "stats.json"
    result = launch(launcher, 2, REPO / "tests" / "helpers" / "bn_recompute_check.py", out, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    stats = json.loads(out.read_text())
    assert stats["images"] == 3 * 4 + 3 * 5
    assert stats["mean"] == pytest.approx(stats["expected_mean"], rel=1e-5, abs=1e-6)
    assert stats["var"] == pytest.approx(stats["expected_var"], rel=1e-5)


@pytest.mark.slow
def test_the_run_evaluates_with_statistics_recomputed_over_the_last_batches(tmp_path):
    """--bn-recompute-batches reaches the evaluation: the checkpoint's BN statistics (saved right after
    the last evaluation) are not the running averages, and depend on K."""
    base = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 32,
            "--synthetic-val-images", 8, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 1]
    stats = {}
    for k in (0, 1, 2):
        result = run_train("--out-dir", f"k{k}", *base, "--bn-recompute-batches", k, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        stats[k] = torch.load(tmp_path / f"k{k}" / "checkpoint.pt", weights_only=True)["model"]["bn1.running_var"]
    assert not torch.equal(stats[0], stats[1]) and not torch.equal(stats[1], stats[2])


def test_a_batch_size_change_covers_every_image_once_per_epoch():
    for world in (1, 2, 3):
        samplers = [TrainBatchSampler(120, 4, rank, world, seed=3) for rank in range(world)]
        for per_rank in (4, 8, 20):  # as Loader.set_batch_size sets it
            seen = []
            for sampler in samplers:
                sampler.resize(per_rank)
                sampler.epoch = 2
                batches = list(sampler)
                assert all(len(b) == per_rank for b in batches) and len(batches) == 120 // (per_rank * world)
                seen += [index for batch in batches for index, _ in batch]
            assert len(seen) == len(set(seen)) == 120 // (per_rank * world) * per_rank * world


SYNTHETIC = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 64,
             "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 3,
             "--batch-schedule", "1:16,2:32", "--log-every", 2, "--eval-every", 1]


@pytest.mark.slow
def test_batch_size_control_resumes_bit_exactly_across_a_change_and_is_logged(tmp_path):
    whole = run_train("--out-dir", "whole", *SYNTHETIC, cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    # stopped in epoch 1 (8 steps at batch 8), resumed across the change, stopped in epoch 2 (4 steps at
    # 16), resumed inside the later phase to the end
    for limit in (5, 10, 0):
        part = run_train("--out-dir", "parts", *(["--resume"] if limit != 5 else SYNTHETIC), "--max-steps", limit,
                         cwd=tmp_path)
        assert part.returncode == 0, part.stderr
    a, b = (torch.load(tmp_path / run / "checkpoint.pt", weights_only=True) for run in ("whole", "parts"))
    assert a["step"] == b["step"] == 8 + 4 + 2  # 64 images at global batch 8, then 16, then 32
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    records = read_metrics(tmp_path / "whole")
    changes = [(r["epoch"], r["step"], r["global_batch"]) for r in records if r["kind"] == "batch"]
    assert changes == [(2, 8, 16), (3, 12, 32)]
    epochs = [(r["step"], r["images"]) for r in records if r["kind"] == "epoch"]
    assert epochs == [(8, 64), (12, 128), (14, 192)]  # every image once per epoch
    assert [(r["step"], r["images"]) for r in records if r["kind"] == "eval"] == epochs
    # the parts also evaluate where they stopped: step 5 (5 x 8 images), step 10 (64 + 2 x 16)
    assert [(r["step"], r["images"]) for r in read_metrics(tmp_path / "parts") if r["kind"] == "eval"] == \
        [(5, 40), (8, 64), (10, 96), (12, 128), (14, 192)]
    again = run_train("--out-dir", "parts", "--resume", "--epochs", 4, "--batch-schedule", "1:32", cwd=tmp_path)
    assert again.returncode == 2 and "resume with the run's own --global-batch-size and --batch-schedule" in \
        again.stderr, again.stderr
    mllog = [json.loads(line[len(":::MLLOG "):]) for line in (tmp_path / "whole" / "mllog.txt").read_text().splitlines()]
    batches = [(e["value"], (e.get("metadata") or {}).get("epoch_num")) for e in mllog if e["key"] == "global_batch_size"]
    assert [value for value, _ in batches] == [8, 16, 32] and batches[1][1] == 2
    checked = compliance(tmp_path / "whole" / "mllog.txt", tmp_path)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout + checked.stderr


@pytest.mark.slow
def test_the_loop_switches_augmentation_off_when_the_schedule_says_so(tmp_path):
    """With augmentation off the crop settings no longer matter: two runs that differ only in them
    end bit-identical; with it on they differ."""
    base = ["--arch", "resnet18", "--image-size", 32, "--global-batch-size", 16, "--max-steps", 2, "--workers", 1,
            "--eval-every", 0, "--epochs", 2]
    weights = {}
    for off in (1, 0):
        for scale in (0.08, 0.5):
            out = f"run-{off}-{scale}"
            result = run_train("--out-dir", out, *base, "--augment-off-epoch", off, "--crop-min-scale", scale,
                               cwd=tmp_path)
            assert result.returncode == 0, result.stderr
            weights[off, scale] = torch.load(tmp_path / out / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(weights[1, 0.08][k], weights[1, 0.5][k]) for k in weights[1, 0.08])
    assert not all(torch.equal(weights[0, 0.08][k], weights[0, 0.5][k]) for k in weights[0, 0.08])


# every seed preset runs a few steps with its mechanisms on (smaller batch and images for CPU) -----
# (--lr: a preset's peak LR diverges on 64 images, so well below it. 32 images at global batch 16: two
# steps an epoch, ResNet-50 as the presets have it. kumar2019 trains in bf16, which a CPU refuses at 16 px)
TINY = ["--lr", 0.05, "--loader", "synthetic", "--image-size", 16, "--synthetic-images", 32, "--synthetic-val-images", 16,
        "--synthetic-classes", 10, "--epochs", 2, "--eval-every", 1, "--log-every", 2, "--target-accuracy", 0]
FP16 = {"TRAINER_ALLOW_CPU_FP16": "1"}


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset,ranks,extra", [
    ("goyal2017-8k", 1, ["--global-batch-size", 16, "--bn-group-size", 8]),  # ghost BN: 2 groups per rank
    ("akiba2017-32k", 1, ["--global-batch-size", 16]),
    ("nvidia-mlperf40-8gpu", 1, ["--global-batch-size", 16]),
    ("jia2018-64k", 2, ["--global-batch-size", 16]),
    ("mikami2018", 2, ["--global-batch-size", 16, "--batch-schedule", "1:32"]),
    ("kumar2019-tpu-32k", 2, ["--global-batch-size", 16, "--bn-span", 2, "--image-size", 24]),
    ("yamazaki2019", 2, ["--global-batch-size", 16, "--augment-off-epoch", 2]),
    ("nvidia-mlperf40-2528gpu", 2, ["--global-batch-size", 16]),
    ("ffcv-rn50-88ep", 1, ["--global-batch-size", 16, "--resolution-schedule", "16:24:0:1:8", "--eval-image-size", 24]),
])
def test_each_seed_preset_trains_a_few_steps(preset, ranks, extra, tmp_path):
    args = ["-m", "train", "--preset", preset, *TINY, *extra, "--out-dir", tmp_path / "run"]
    result = launch("torch" if ranks > 1 else "none", ranks, *args, cwd=tmp_path, env=FP16, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    evals = [r for r in records if r["kind"] == "eval"]
    assert len(evals) == 2 and evals[-1]["eval_images"] == 16
    if ranks > 1:
        assert [r["differing_from_rank0"] for r in records if r["kind"] == "replicas"] == [0]
    if preset.startswith("ffcv"):  # its own crop sizes, scaled down: 16 px, then 24; evaluated at 24 with flips
        assert [r["image_size"] for r in records if r["kind"] == "epoch"] == [16, 24]
    if preset == "mikami2018":
        assert [(r["epoch"], r["global_batch"]) for r in records if r["kind"] == "batch"] == [(2, 32)]


@pytest.mark.slow
def test_the_run_uses_ghost_batchnorm_groups_and_a_group_of_the_whole_batch_is_plain_bn(tmp_path):
    base = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 32,
            "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 1, "--eval-every", 0, "--max-steps", 2]
    weights = {}
    for group in (0, 8, 4):
        result = run_train("--out-dir", f"g{group}", *base, "--bn-group-size", group, cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        weights[group] = torch.load(tmp_path / f"g{group}" / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(weights[0][k], weights[8][k]) for k in weights[0])  # G = per-rank batch: plain BN
    assert not all(torch.equal(weights[0][k], weights[4][k]) for k in weights[0])  # two groups of 4
