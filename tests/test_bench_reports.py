"""`python -m train.bench` reports what it measured (train/bench.py; docs/bench.md): `train` names the
crop size its measured steps ran at under a --resolution-schedule, and prints and logs the LR of the
last measured step (the quiet steps timed after it put back what they change); `infer` times a run
evaluated with --eval-flip as that evaluation runs (two passes, the logits averaged), honours
--image-size on a run and says so; scripts/bench/time_to_accuracy.py describes every option.
Tiny runs: resnet18 at 24-32 px, a few steps, synthetic data."""
import json
import re
import subprocess
import sys

import pytest

from helpers import REPO, child_env, read_metrics, run_module, run_train, script_options

TINY = ["--arch", "resnet18", "--image-size", 32, "--threads", 1]
# 1600 synthetic images in batches of 16: 100 steps an epoch; --warmup-epochs 1 at --lr 4 makes the
# LR of step k 4 k / 100 (LARS's linear warmup, docs/lars.md)
WARMUP_RUN = ["--synthetic-images", 1600, "--batch-size", 16, "--optimizer", "lars", "--lr", 4, "--warmup-epochs", 1]
RAMP = ["--resolution-schedule", "24:32:0:1:8"]  # 24 px in the first epoch, 32 px from the second on


def bench(*args, cwd):
    done = run_module("train.bench", *args, cwd=cwd)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def benchmark_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("benchmark: "))


@pytest.fixture(scope="module")
def ramped(tmp_path_factory):
    """A benchmark of 1 warm-up and 3 measured steps, all in the first epoch of a 24 -> 32 px ramp,
    its run's logs kept: (stdout, report, the run's epoch record)."""
    work = tmp_path_factory.mktemp("ramped")
    done = bench("train", *TINY, *WARMUP_RUN, *RAMP, "--warmup-steps", 1, "--steps", 3, "--out-dir", work / "run",
                 "--report", work / "report.json", cwd=work)
    epoch, = (r for r in read_metrics(work / "run") if r["kind"] == "epoch")
    return done.stdout, json.loads((work / "report.json").read_text()), epoch


@pytest.mark.slow(seconds=10)
def test_bench_train_names_the_crop_size_its_measured_steps_ran_at(ramped):
    stdout, report, epoch = ramped
    assert epoch["image_size"] == 24  # (what the run's own log says it trained at)
    assert benchmark_line(stdout).startswith("benchmark: resnet18 at 24 px (--resolution-schedule's crop"), stdout
    assert "not --image-size 32" in benchmark_line(stdout)
    assert report["image_size"] == 24 and report["image_sizes"] == [24], report


@pytest.mark.slow(seconds=10)
def test_bench_train_prints_and_logs_the_lr_of_the_last_measured_step(ramped):
    """The 4th step's LR, 4 x 4 / 100 = 0.16, not the 9th's (0.36) that the 5 quiet steps reached."""
    stdout, _, epoch = ramped
    epoch_line = next(line for line in stdout.splitlines() if line.startswith("epoch   1/"))
    printed_lr = float(epoch_line.split(" lr ")[1].split()[0])
    assert re.search(r"\bstep +4\b", epoch_line) and printed_lr == pytest.approx(0.16), epoch_line
    assert epoch["step"] == 4 and epoch["lr"] == pytest.approx(0.16), epoch


@pytest.mark.slow(seconds=10)
def test_bench_train_says_when_its_measured_steps_span_crop_sizes(tmp_path):
    """64 images in batches of 16: epoch 1 (24 px) is steps 1-4, step 5 the first of epoch 2 (32 px);
    measured steps 2-5 span both."""
    done = bench("train", *TINY, *RAMP, "--synthetic-images", 64, "--batch-size", 16, "--warmup-steps", 1,
                 "--steps", 4, "--report", tmp_path / "report.json", cwd=tmp_path)
    line = benchmark_line(done.stdout)
    assert line.startswith("benchmark: resnet18 at 24 px for 3 steps and 32 px for 1 step (--resolution-schedule "
                           "changed the crop"), line
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["image_size"] is None and report["image_sizes"] == [24, 32], report


@pytest.mark.slow(seconds=10)
def test_the_quiet_steps_put_back_the_lr_and_the_optimizers_settings(tmp_path):
    """tests/helpers/quiet_steps_check.py reads the run at the last measured step on each side of the
    StepTimer: after its 5 quiet steps the run's LR and every parameter group's lr are the measured
    step's again (step 4: 0.16), as before them."""
    done = subprocess.run([sys.executable, REPO / "tests" / "helpers" / "quiet_steps_check.py", tmp_path / "run"],
                          cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    read = json.loads(done.stdout.splitlines()[-1])
    assert read["quiet_steps"] == 5
    for side in ("before", "after"):
        assert read[side]["step"] == 4 and read[side]["lr"] == pytest.approx(0.16), read
        assert read[side]["group_lrs"] and all(lr == pytest.approx(0.16) for lr in read[side]["group_lrs"]), read


# infer ---------------------------------------------------------------------------------------------
INFER = ["--backends", "eager", "--batch-sizes", 1, "--warmup-iterations", 1, "--iterations", 1, "--threads", 1]


@pytest.fixture(scope="module")
def flipped_run(tmp_path_factory):
    """A one-epoch run at 32 px evaluated with --eval-flip."""
    work = tmp_path_factory.mktemp("flipped")
    done = run_train("--loader", "synthetic", "--synthetic-images", 32, "--synthetic-classes", 4,
                     "--synthetic-val-images", 8, *TINY, "--batch-size", 4, "--epochs", 1, "--eval-flip",
                     "--out-dir", work / "run", cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    return work / "run"


def infer(source, tmp_path, *flags) -> tuple[str, dict]:
    """bench infer's header line and report."""
    report = tmp_path / "infer.json"
    done = bench("infer", *([source] if source else []), *INFER, *flags, "--report", report, cwd=tmp_path)
    header = next(line for line in done.stdout.splitlines() if line.startswith("inference benchmark: "))
    return header, json.loads(report.read_text())


@pytest.mark.slow(seconds=15)
def test_infer_times_a_run_evaluated_with_flips_as_two_passes_unless_no_flip(flipped_run, tmp_path):
    header, report = infer(flipped_run, tmp_path)
    assert "at 32 px, two passes per batch (as the run's evaluation: the images and their mirror images, the " \
           "logits averaged)" in header, header
    assert report["flip"] is True and report["image_size"] == 32, report
    header, report = infer(flipped_run, tmp_path, "--no-flip")
    assert "one pass per batch (--no-flip; the run's evaluation takes two" in header, header
    assert report["flip"] is False, report
    header, report = infer("", tmp_path, "--arch", "resnet18", "--image-size", 32)
    assert "untrained resnet18 at 32 px, one pass per batch," in header, header
    assert report["flip"] is False and report["image_size"] == 32, report


@pytest.mark.slow(seconds=10)
def test_infer_times_a_run_at_the_image_size_given_and_says_it_is_not_the_runs(flipped_run, tmp_path):
    header, report = infer(flipped_run, tmp_path, "--image-size", 64)
    assert "at 64 px (--image-size; the run evaluates at 32 px)" in header, header
    assert report["image_size"] == 64, report


@pytest.mark.slow(seconds=8)
@pytest.mark.parametrize("backend", ["eager", "onnxruntime"])
def test_a_flipped_call_is_the_mean_of_the_logits_of_the_batch_and_of_its_mirror_images(backend, tmp_path):
    """The timed call itself (train/bench.py _backend): with flip, the model runs on the batch and on
    its mirror images (2 passes) and returns the mean of the two logits, as train/evaluate.py does;
    without, one pass."""
    import torch

    from models import build_model
    from train.bench import _backend
    from train.precision import Precision
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
        pytest.importorskip("onnxscript")
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model = build_model("resnet18", 4, channels_last=True).eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain, mirrored = model(images), model(images.flip(3))
    inputs = []
    model.register_forward_pre_hook(lambda module, args: inputs.append(args[0].clone()))
    for flip, expected in ((True, (plain + mirrored) / 2), (False, plain)):
        inputs.clear()
        call = _backend(backend, model, 32, Precision("fp32", cpu), cpu, tmp_path, flip)
        inputs.clear()  # (the export's own traced passes)
        logits = torch.as_tensor(call(images))
        assert torch.allclose(logits, expected, atol=1e-4), (flip, logits, expected)
        if backend == "eager":
            assert len(inputs) == (2 if flip else 1)
            assert torch.equal(inputs[-1], images.flip(3) if flip else images)
    assert not torch.allclose(plain, (plain + mirrored) / 2, atol=1e-3)  # (the flip shows in the logits)


# scripts/bench/time_to_accuracy.py -----------------------------------------------------------------
def test_time_to_accuracy_help_describes_every_option():
    said = script_options(REPO / "scripts" / "bench" / "time_to_accuracy.py")
    assert set(said) == {"-h", "--out", "--datasets", "--methods", "--seeds", "--epochs", "--table"}, said
    assert [option for option, text in said.items() if not text] == []


# scripts/bench/accumulation.py --------------------------------------------------------------------
def test_accumulation_bench_options_have_help_and_are_documented():
    said = script_options(REPO / "scripts" / "bench" / "accumulation.py")
    said.pop("-h")
    assert {"--quick", "--report", "--accumulation-steps", "--repeats"} <= set(said), said
    assert [option for option, text in said.items() if not text] == []
    docs = (REPO / "docs" / "bench.md").read_text()
    section = docs.split("## `scripts/bench/accumulation.py`", 1)[1].split("\n## ", 1)[0]
    assert [option for option in said if option not in section] == []
