"""The methods that cut epochs to a top-1 (docs/time_to_accuracy.md): test-time flips, evaluation at
its own resolution, progressive resizing (in every loader, the planner and the scorer), the average
of the weights (what is evaluated, checkpointed, predicted and exported), the FFCV presets, and the
flags' refusals; each against arithmetic done here by hand, and whole runs on one and two ranks."""
import math
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from helpers import read_metrics, run_train
from data.loaders import SyntheticLoader
from train.config import Config
from train.engines.single import SingleProcess
from train.evaluate import evaluate
from train.precision import Precision
from train.crops import resolution_ramp
from train.score.flops import run_flop
from train.score.runs import score_run


class Mirrored(torch.nn.Module):
    """A linear classifier of the whole image: mirroring an image changes its logits."""

    def __init__(self, size: int, classes: int):
        super().__init__()
        torch.manual_seed(3)
        self.linear = torch.nn.Linear(3 * size * size, classes)

    def forward(self, x):
        return self.linear(x.flatten(1))


@pytest.mark.parametrize("flip", [False, True])
def test_eval_flip_scores_the_mean_of_each_images_and_its_mirrors_logits(flip):
    cfg = Config(loader="synthetic", image_size=8, batch_size=16, synthetic_images=16, synthetic_val_images=64,
                 synthetic_classes=4, channels_last=False)
    loader, engine = SyntheticLoader(cfg, 0, 1, torch.device("cpu")), SingleProcess(cfg)
    model = Mirrored(8, 4)
    top1, top5, images = evaluate(model, loader, Precision("fp32", engine.device), engine, flip=flip)
    hits = hits_flipped = 0
    with torch.no_grad():
        for x, labels in loader.val_batches():  # by hand: the logits of x, and of x mirrored left to right
            logits = model.linear(x.reshape(len(x), -1))
            mirrored = model.linear(torch.flip(x, dims=[3]).reshape(len(x), -1))
            hits += int((logits.argmax(1) == labels).sum())
            hits_flipped += int(((logits + mirrored).argmax(1) == labels).sum())
    assert images == 64 and hits != hits_flipped  # (the mirror changes some predictions here)
    assert top1 == (hits_flipped if flip else hits) / 64


@pytest.mark.parametrize("argv, match", [
    (["--eval-image-size", "8"], "--eval-image-size must be 0 (as --image-size) or a crop size from 16 to 1024 px, got 8"),
    (["--eval-image-size", "1025"], "--eval-image-size must be 0 (as --image-size) or a crop size from 16 to 1024 px"),
    (["--image-size", "1025"], "--image-size must be a crop size from 16 to 1024 px, got 1025"),
    (["--resolution-schedule", "160:192:1:2:12"], "--resolution-schedule '160:192:1:2:12': STEP 12 is not a positive multiple "
                                                  "of 8 (the ramp rounds its sizes to multiples of STEP); give 8, 16"),
    (["--resolution-schedule", "160:192:5"], "--resolution-schedule '160:192:5': has 3 values, not 4 or 5"),
    (["--resolution-schedule", "160:192:5:2"], "FROM 5 is after TO 2; give FROM not above TO"),
    (["--resolution-schedule", "160:192:0.5:1.5"], "FROM 0.5 is not a whole number of epochs"),
    (["--resolution-schedule", "-8:32:0:1"], "--resolution-schedule '-8:32:0:1': START -8 is not a crop size"),
    (["--ema-decay", "1"], "--ema-decay must be in [0, 1), got 1.0"),
    (["--ema-decay", "-0.1"], "--ema-decay must be in [0, 1), got -0.1"),
])
def test_bad_method_values_are_one_line_and_exit_2(argv, match, tmp_path):
    done = subprocess.run([sys.executable, "-m", "train", "--out-dir", str(tmp_path / "run"), *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and match in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run").exists()  # nothing half-written


# progressive resizing ----------------------------------------------------------------------------
def test_the_resolution_ramp_holds_then_steps_in_multiples_as_ffcvs_does():
    """FFCV's 88-epoch ramp, by hand: 160 + 32 (e - 65) / 11 px after e epochs, rounded to a multiple
    of 32: 174.5 at e = 70 rounds to 160, 177.5 at e = 71 to 192. And in steps of 8 over a short run."""
    ffcv = resolution_ramp("160:192:65:76")
    assert [ffcv(e) for e in range(88)] == [160] * 71 + [192] * 17
    assert [resolution_ramp("16:32:2:6:8")(e) for e in range(8)] == [16, 16, 16, 16, 24, 32, 32, 32]  # 20 -> 16, 28 -> 32
    assert resolution_ramp("32:16:0:2:8").sizes(3) == [32, 24, 16]  # (downwards too)
    assert resolution_ramp("") is None


def test_the_per_gpu_batch_is_chosen_for_the_largest_crop_of_the_run(monkeypatch):
    from types import SimpleNamespace
    from train.device_choices import default_batch
    from train.crops import largest_image_size
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=8 * 2 ** 30))
    gpu = torch.device("cuda", 0)
    ramped = Config(image_size=128, resolution_schedule="128:256:1:2")
    assert largest_image_size(ramped) == 256 and largest_image_size(Config(image_size=128)) == 128
    assert default_batch(gpu, "fp32", largest_image_size(ramped), "resnet50")[0] == default_batch(gpu, "fp32", 256, "resnet50")[0]
    assert default_batch(gpu, "fp32", 256, "resnet50")[0] < default_batch(gpu, "fp32", 128, "resnet50")[0]


@pytest.fixture(scope="module")
def gradients(tmp_path_factory):
    """A small tree of real JPEGs (three classes, sizes 40-100 px), and the same as tar shards."""
    import numpy as np
    from PIL import Image
    from data.shards import write_shards
    root = tmp_path_factory.mktemp("gradients")
    rng = np.random.default_rng(0)
    for split, count in (("train", 6), ("val", 3)):
        for blue, cls in ((200, "a"), (40, "b"), (120, "c")):
            (root / "tree" / split / cls).mkdir(parents=True)
            for i in range(count):
                h, w = rng.integers(40, 100, 2)
                y, x = np.mgrid[0:h, 0:w]
                pixels = np.stack([x / w * 255, y / h * 255, np.full((h, w), blue)], axis=-1).astype(np.uint8)
                Image.fromarray(pixels).save(root / "tree" / split / cls / f"{cls}{i}.jpg", quality=95)
    write_shards(root / "tree", root / "shards", shard_size=5)
    return root


def _loader(kind: str, source: str, root):
    from data import build_loader
    from data.loaders import LoaderSettings
    cfg = Config(loader=kind, data_dir=str(root / source) if kind != "synthetic" else "", image_size=32,
                 eval_image_size=40, batch_size=4, workers=1, synthetic_images=16, synthetic_val_images=8,
                 synthetic_classes=3)
    return build_loader(kind, LoaderSettings.of(cfg), 0, 1, torch.device("cpu"))


@pytest.mark.parametrize("kind, source", [("torch", "tree"), ("torch", "shards"), ("dali", "tree"), ("dali", "shards"),
                                          ("synthetic", "")])
def test_every_loader_trains_at_the_epochs_crop_size_and_evaluates_at_its_own(gradients, kind, source):
    if kind == "dali":
        pytest.importorskip("nvidia.dali")
    loader = _loader(kind, source, gradients)
    try:
        for size in (16, 24, 32):
            loader.set_image_size(size)
            for augment in (True, False):  # (--augment-off-epoch: the evaluation transform at the training size)
                shapes = {tuple(x.shape[1:]) for x, _ in loader.train_batches(epoch=0, augment=augment)}
                assert shapes == {(3, size, size)}, (size, augment)
            assert {tuple(x.shape[1:]) for x, _ in loader.val_batches()} == {(3, 40, 40)}
    finally:
        loader.close()


def test_the_plan_of_a_resolution_schedule_runs_each_size_at_its_pixels_cost(capsys):
    """The 88-epoch FFCV preset on 8 A100s: 71 epochs at 160 px, then 17 at 192; the compute of a step
    grows with the pixels from the same fit as a 224 px run's: (c192 - c160) / (c224 - c160) is
    (192^2 - 160^2) / (224^2 - 160^2)."""
    from train.plan.cli import main
    main(["--preset", "ffcv-rn50-88ep", "--gpu", "a100", "--gpus", "8", "--json"])
    (row,), _ = __import__("json").loads(capsys.readouterr().out), None
    low, high = row["phases"]
    assert (low["epochs"], low["image_size"], high["epochs"], high["image_size"]) == (71, 160, 17, 192)
    main(["--preset", "goyal2017-8k", "--gpu", "a100", "--gpus", "8", "--per-gpu-batch", "128", "--json"])
    (full,) = __import__("json").loads(capsys.readouterr().out)
    assert full["per_gpu_batch"] == low["per_gpu_batch"] == 128
    ratio = (high["compute_s"] - low["compute_s"]) / (full["compute_s"] - low["compute_s"])
    assert ratio == pytest.approx((192 ** 2 - 160 ** 2) / (224 ** 2 - 160 ** 2))
    assert row["steps"] == low["steps"] + high["steps"] == math.ceil(71 * 1281167 / 1024) + math.ceil(17 * 1281167 / 1024)


def test_the_flops_of_a_resized_run_count_each_epoch_at_its_crop_size():
    from models.flops import eval_flops_per_image, train_flops_per_image
    from train.score.flops import run_flop
    config = {"arch": "resnet18", "image_size": 32, "resolution_schedule": "16:32:0:1:16", "eval_image_size": 40,
              "num_classes": 10}
    by_hand = (100 * train_flops_per_image("resnet18", 16, 10) + 200 * train_flops_per_image("resnet18", 32, 10)
               + 50 * eval_flops_per_image("resnet18", 40, 10))
    assert run_flop(config, 300, 50, [{"kind": "epoch", "epoch": e, "images": n} for e, n in ((1, 100), (2, 200), (3, 300))]) == pytest.approx(by_hand)


# the average of the weights --------------------------------------------------------------------
def test_the_weight_average_is_the_decayed_mean_after_each_step():
    from models import build_model
    from train.ema import WeightAverage
    torch.manual_seed(0)
    model = build_model("resnet18", 3)
    average = WeightAverage(model, 0.9, "resnet18", 3, channels_last=False, blurpool=False)
    expected = {name: t.clone() for name, t in model.state_dict().items()}
    for step in range(3):  # a "step": every weight and running statistic moves, and BN counts a batch
        with torch.no_grad():
            for name, tensor in model.state_dict().items():
                tensor.add_(torch.randn_like(tensor.float()).to(tensor.dtype) if tensor.is_floating_point() else 1)
        average.update()
        for name, tensor in model.state_dict().items():  # by hand: a <- 0.9 a + 0.1 w; counters copied
            expected[name] = 0.9 * expected[name] + 0.1 * tensor if tensor.is_floating_point() else tensor.clone()
    got = average.state_dict()
    for name, tensor in expected.items():
        assert torch.allclose(got[name], tensor, atol=1e-6), name
    assert not torch.equal(got["fc.weight"], model.state_dict()["fc.weight"])  # its own tensors, not the model's


def _methods(epochs=2):
    return ["--arch", "resnet18", "--image-size", 32, "--resolution-schedule", "16:32:0:1:16", "--eval-image-size", 40,
            "--eval-flip", "--ema-decay", 0.9, "--blurpool", "--lr-schedule", "cosine", "--epochs", epochs,
            "--workers", 1, "--log-every", 5, "--eval-every", 1]


@pytest.mark.slow
def test_a_run_with_every_method_resumes_bit_exactly_and_its_average_is_what_is_evaluated(tmp_path):
    whole = run_train("--out-dir", "whole", *_methods(), cwd=tmp_path)
    assert whole.returncode == 0, whole.stderr
    assert "epoch 1: training crops of 16 px" in whole.stdout and "epoch 2: training crops of 32 px" in whole.stdout
    first = run_train("--out-dir", "parts", *_methods(), "--max-steps", 20, cwd=tmp_path)  # stopped in epoch 2
    assert first.returncode == 0, first.stderr
    second = run_train("--out-dir", "parts", *_methods(), "--resume", "--max-steps", 0, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    a, b = (torch.load(tmp_path / run / "checkpoint.pt", weights_only=True) for run in ("whole", "parts"))
    for entry in ("model", "ema"):
        assert a[entry].keys() == b[entry].keys()
        assert all(torch.equal(a[entry][k], b[entry][k]) for k in a[entry]), entry
    assert all(torch.equal(s["momentum_buffer"], b["optimizer"]["state"][k]["momentum_buffer"])
               for k, s in a["optimizer"]["state"].items())
    assert not all(torch.equal(a["model"][k], a["ema"][k]) for k in a["model"])  # an average, not a copy
    records = read_metrics(tmp_path / "whole")
    assert [r["image_size"] for r in records if r["kind"] == "epoch"] == [16, 32]
    # scored from mllog.txt alone, each epoch's images still count at their crop size
    shutil.copytree(tmp_path / "whole", tmp_path / "bare", ignore=shutil.ignore_patterns("metrics.jsonl", "*.pt"))
    scored, bare = (score_run(tmp_path / run, 0.5, 5, 0.5, check=False) for run in ("whole", "bare"))
    assert bare.total_flop == scored.total_flop > run_flop({**yaml.safe_load((tmp_path / "whole" / "config.yaml").read_text()),
                                                             "resolution_schedule": "", "image_size": 16}, scored.images, 600)
    # the first epoch trained on 16 px crops: its weights are those of a run at --image-size 16
    for run, flags in (("ramped", []), ("small", ["--image-size", 16, "--resolution-schedule", ""])):
        done = run_train("--out-dir", run, *_methods(), *flags, "--max-steps", 15, "--eval-every", 0, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    ramped, small = (torch.load(tmp_path / run / "checkpoint.pt", weights_only=True)["model"] for run in ("ramped", "small"))
    assert all(torch.equal(ramped[k], small[k]) for k in ramped)
    assert [r["eval_images"] for r in records if r["kind"] == "eval"] == [300, 300]

    # --test-only, predict and export read the average: its classifier set to say class 0 always scores
    # class 0's share of the validation images (30 of 300), whatever the trained weights say
    from train.inference import load_trained
    trained = load_trained(tmp_path / "whole", torch.device("cpu"))
    assert trained.image_size == 40 and all(torch.equal(trained.model.state_dict()[k], a["ema"][k]) for k in a["ema"])
    a["ema"]["fc.weight"].zero_()
    a["ema"]["fc.bias"].copy_(torch.arange(10, 0, -1.0))
    torch.save(a, tmp_path / "whole" / "class0.pt")
    tested = run_train("--out-dir", "whole", "--test-only", "--checkpoint", "class0.pt", cwd=tmp_path)
    assert tested.returncode == 0, tested.stderr
    assert "top-1 0.1000" in tested.stdout and "(300 images)" in tested.stdout, tested.stdout


def test_init_from_a_run_that_kept_an_average_starts_from_the_average(tmp_path):
    """The weights such a run evaluated, as --test-only, predict and export take them; and it says so."""
    from models import build_model
    from train.checkpoint import load_weights
    trained = build_model("resnet18", 10).state_dict()
    average = {name: tensor + 1 if tensor.is_floating_point() else tensor for name, tensor in trained.items()}
    torch.save({"step": 5, "model": trained, "ema": average}, tmp_path / "checkpoint.pt")
    weights, found = load_weights(tmp_path / "checkpoint.pt", "check --init-from")
    assert all(torch.equal(weights[name], average[name]) for name in trained) and weights.keys() == trained.keys()
    assert found == ["the average under 'ema'"]
    torch.save({"step": 5, "model": trained}, tmp_path / "plain.pt")  # without one: the trained weights
    assert all(torch.equal(load_weights(tmp_path / "plain.pt", "")[0][name], trained[name]) for name in trained)


def _tree_and_shards(tmp_path):
    from data.embedded import ensure_embedded
    from data.shards import write_shards
    write_shards(ensure_embedded(), tmp_path / "shards", shard_size=200)
    return tmp_path / "shards"


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher, loader, source", [("torch", "dali", "tree"), ("horovod", "torch", "shards")])
def test_every_method_on_two_ranks_keeps_the_ranks_alike(tmp_path, launcher, loader, source):
    from helpers import launch
    if loader == "dali":
        pytest.importorskip("nvidia.dali")
    data = ["--data-dir", _tree_and_shards(tmp_path)] if source == "shards" else ["--preset", "smoke"]
    result = launch(launcher, 2, "-m", "train", *data, *_methods(), "--loader", loader, "--global-batch-size", 64,
                    "--out-dir", tmp_path / "run", cwd=tmp_path, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["differing_from_rank0"] for r in records if r["kind"] == "replicas"] == [0]
    assert [r["image_size"] for r in records if r["kind"] == "epoch"] == [16, 32]
    assert [r["eval_images"] for r in records if r["kind"] == "eval"] == [300, 300]
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)
    assert saved["ema"].keys() == saved["model"].keys()


def test_the_ffcv_presets_recipes_are_its_published_settings():
    from train.cli import parse
    from train.recipe import recipe
    long, short = (recipe(parse(["--preset", name, "--show-recipe"])) for name in ("ffcv-rn50-88ep", "ffcv-rn50-16ep"))
    for shown, epochs in ((long, 88), (short, 16)):
        c = shown["config"]
        assert (c["arch"], c["global_batch_size"], c["optimizer"], c["lr"], c["lr_schedule"], c["warmup_epochs"],
                c["momentum"], c["weight_decay"], c["label_smoothing"], c["blurpool"], c["eval_image_size"],
                c["eval_flip"], c["epochs"]) == ("resnet50", 1024, "sgd", 1.7, "linear", 2, 0.9, 1e-4, 0.1, True, 256,
                                                 True, epochs)
        steps = 1281167 // 1024  # per epoch, on ImageNet (the embedded dataset holds less than one global batch)
        assert shown["epochs"][0]["lr_first"] == pytest.approx(1.7 / (2 * steps))  # the first step of the warmup
        assert shown["epochs"][1]["lr_last"] == pytest.approx(1.7)  # its last
        assert shown["epochs"][-1]["lr_last"] == 0  # a straight line down to 0
    assert [e["image_size"] for e in long["epochs"]] == [160] * 71 + [192] * 17
    assert {e["image_size"] for e in short["epochs"]} == {160}


def test_a_run_changed_by_a_method_is_scored_at_the_free_level():
    from train.score.level import hpc_ai500_level
    reference = {"arch": "resnet50", "image_size": 224, "preset": "mlperf-bs3264"}
    assert hpc_ai500_level(reference)[0] == "hardware"
    for changed in ({"blurpool": True}, {"resolution_schedule": "160:224:10:20"}, {"eval_image_size": 256},
                    {"eval_flip": True}):
        level, reason = hpc_ai500_level({**reference, **changed})
        assert level == "free" and next(iter(changed)) in reason
    level, reason = hpc_ai500_level({**reference, "ema_decay": 0.999})
    assert level == "system" and "ema_decay" in reason
