"""The seed systems' recipes: each preset's --show-recipe against the published table
(docs/seed_systems.md), and each recipe's schedule mechanisms against their formulas."""
import json
import math

import pytest

from helpers import run_train
from data.embedded import ensure_embedded
from train.cli import parse
from train.config import Config
from train.errors import UsageError
from train.recipe import recipe, show_recipe
from train.schedule import EpochClock, EpochPlan, SgdShareRamp, build_lr_schedule

END_LR = 1e-4


def show(preset: str) -> dict:
    return recipe(parse(["--preset", preset, "--show-recipe"]))


def column(epochs: list[dict], key: str, first: int, last: int) -> list:
    return [e[key] for e in epochs[first - 1:last]]


def lrs(epochs: list[dict], first: int, last: int) -> list:
    """The LR at the first and last step of epochs first..last (counted from 1)."""
    return column(epochs, "lr_first", first, last) + column(epochs, "lr_last", first, last)


@pytest.mark.slow
def test_show_recipe_prints_one_json_object_and_trains_nothing(tmp_path):
    result = run_train("--preset", "goyal2017-8k", "--show-recipe", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["config"]["global_batch_size"] == 8192 and len(shown["epochs"]) == 90
    assert set(shown["epochs"][0]) == {"epoch", "global_batch", "accumulation_steps", "lr_first", "lr_last", "image_size", "augment"}
    assert list(tmp_path.iterdir()) == []  # no run directory


def test_the_smoke_recipe_counts_the_embedded_dataset_the_run_trains_on():
    r = show("smoke")
    images = len(list((ensure_embedded() / "train").rglob("*.JPEG")))  # the dataset a run without --data-dir uses
    assert r["train_images"] == images == 1000 and "embedded" in r["train_images_source"]
    steps = 1000 // 64  # smoke: global batch 64, LR 4.0, 2 warmup epochs; warmup step k: 4.0 x k / (2 x steps)
    assert r["epochs"][0]["lr_first"] == pytest.approx(4.0 * 1 / (2 * steps))
    assert r["epochs"][1]["lr_last"] == pytest.approx(4.0)


def test_a_recipe_counts_the_data_it_is_given(tmp_path):
    source = sorted((ensure_embedded() / "train" / "red_hstripes").iterdir())[:3]
    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / split / cls).mkdir(parents=True)
            for f in source:
                (tmp_path / split / cls / f.name).write_bytes(f.read_bytes())
    r = recipe(parse(["--data-dir", str(tmp_path), "--global-batch-size", "2", "--epochs", "4", "--lr", "1",
                      "--warmup-epochs", "1", "--show-recipe"]))
    assert r["train_images"] == 6 and str(tmp_path) in r["train_images_source"]
    assert r["epochs"][0]["lr_first"] == pytest.approx(1 / 3)  # 6 // 2 = 3 steps in the warmup epoch
    synthetic = recipe(parse(["--loader", "synthetic", "--synthetic-images", "640", "--show-recipe"]))
    assert synthetic["train_images"] == 640 and synthetic["train_images_source"] == "--synthetic-images"


def test_a_preset_too_big_for_the_embedded_dataset_is_counted_on_imagenet():
    r = show("nvidia-mlperf40-8gpu")
    assert r["train_images"] == 1_281_167 and r["train_images_source"].startswith("ImageNet's")


def test_show_recipe_makes_the_checks_a_run_makes(tmp_path):
    with pytest.raises(UsageError, match="--bn-group-size 3 does not divide the per-rank batch 8"):
        recipe(parse(["--loader", "synthetic", "--synthetic-images", "32", "--global-batch-size", "8",
                      "--bn-group-size", "3", "--show-recipe"]))
    result = run_train("--show-recipe", "--lr", "inf", cwd=tmp_path)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and result.stdout == "" and lines == ["error: --lr must be a finite number, got inf"]


def test_show_recipe_prints_strict_json_or_nothing(capsys):
    """A NaN or an infinity is no JSON: a settings object that skipped validation fails loudly instead."""
    with pytest.raises(ValueError):
        show_recipe(Config(lr=math.inf, warmup_epochs=1, global_batch_size=64, epochs=2))
    assert capsys.readouterr().out == ""


def test_goyal_2017():
    r = show("goyal2017-8k")
    cfg, epochs = r["config"], r["epochs"]
    assert (cfg["optimizer"], cfg["nesterov"], cfg["momentum"], cfg["weight_decay"]) == ("sgd", True, 0.9, 1e-4)
    assert cfg["lr"] == pytest.approx(0.1 * 8192 / 256) and cfg["label_smoothing"] == 0
    assert cfg["bn_group_size"] == 32 and cfg["zero_init_residual"] and len(epochs) == 90
    assert set(column(epochs, "global_batch", 1, 90)) == {8192}
    steps = 1_281_167 // 8192
    assert epochs[0]["lr_first"] == pytest.approx(0.1 + (3.2 - 0.1) / (5 * steps))  # per-step warmup from 0.1
    assert epochs[4]["lr_last"] == pytest.approx(3.2)
    for first, last, lr in ((6, 30, 3.2), (31, 60, 0.32), (61, 80, 0.032), (81, 90, 0.0032)):
        assert lrs(epochs, first, last) == pytest.approx([lr] * 2 * (last - first + 1)), (first, last)


def test_akiba_2017():
    r = show("akiba2017-32k")
    cfg, epochs = r["config"], r["epochs"]
    assert cfg["optimizer"] == "rmsprop-warmup" and cfg["lr"] == pytest.approx(12.8)
    assert cfg["bn_recompute_batches"] == 1 and cfg["fp16_allreduce"] and len(epochs) == 90
    for first, last, factor in ((1, 40, 0.5), (41, 70, 0.075), (71, 85, 0.01), (86, 90, 0.001)):
        assert lrs(epochs, first, last) == pytest.approx([12.8 * factor] * 2 * (last - first + 1)), (first, last)
    shares = [e["sgd_share"] for e in epochs]  # at each epoch's first step: epochs done = epoch - 1
    assert shares[:8] == [0.0] * 8 and shares[13:] == [1.0] * 77  # the rise: epochs 7.5 to 12.5
    assert shares[10] == pytest.approx(0.5) and shares == sorted(shares)


def test_jia_2018():
    r = show("jia2018-64k")
    cfg, epochs = r["config"], r["epochs"]
    assert (cfg["global_batch_size"], cfg["optimizer"], cfg["precision"], cfg["allreduce"]) == \
        (65536, "lars", "fp16", "hierarchical")
    assert (cfg["lr"], cfg["warmup_epochs"], cfg["weight_decay"], cfg["momentum"]) == (24.699, 31, 1e-4, 0.951807)
    assert len(epochs) == 88 and epochs[30]["lr_last"] == pytest.approx(24.699)
    assert epochs[-1]["lr_last"] == pytest.approx(END_LR)


def test_mikami_2018():
    r = show("mikami2018")
    cfg, epochs = r["config"], r["epochs"]
    assert column(epochs, "global_batch", 1, 88) == [34816] * 30 + [69632] * 58
    assert (cfg["allreduce"], cfg["label_smoothing"], cfg["optimizer"]) == ("torus", 0.1, "lars")
    # the MLPerf table between 32768 (LR 21.2, warmup 16) and 49152 (19.405, 24), in log2 of the batch
    share = math.log2(34816 / 32768) / math.log2(49152 / 32768)
    assert cfg["lr"] == pytest.approx(21.2 + share * (19.405 - 21.2))
    assert cfg["warmup_epochs"] == pytest.approx(16 + share * 8)
    # from epoch 31 the peak is the table's LR for 69632 (held at its last point, 65536: 24.699)
    jump = (epochs[30]["lr_first"] - END_LR) / (epochs[29]["lr_last"] - END_LR)
    assert jump == pytest.approx(24.699 / cfg["lr"], rel=0.01)
    assert epochs[-1]["lr_last"] == pytest.approx(END_LR) and len(epochs) == 88


def test_kumar_2019_tpu():
    r = show("kumar2019-tpu-32k")
    cfg, epochs = r["config"], r["epochs"]
    assert (cfg["global_batch_size"], cfg["bn_span"], cfg["precision"], cfg["lars_epsilon"]) == (32768, 8, "bf16", 1e-5)
    assert (cfg["lr"], cfg["warmup_epochs"], cfg["weight_decay"], cfg["label_smoothing"]) == (31.2, 25, 1e-4, 0.1)
    assert len(epochs) == 72 and epochs[24]["lr_last"] == pytest.approx(31.2)
    assert epochs[-1]["lr_last"] == pytest.approx(END_LR)


def test_yamazaki_2019():
    r = show("yamazaki2019")
    cfg, epochs = r["config"], r["epochs"]
    assert cfg["global_batch_size"] == 42 * 2048 and (cfg["lars_eta"], cfg["momentum"], cfg["weight_decay"]) == \
        (0.0025, 0.96, 5e-5)
    assert (cfg["precision"], cfg["allreduce"], cfg["init_from_seed"], cfg["label_smoothing"]) == \
        ("fp16", "hierarchical", True, 0.1)
    assert len(epochs) == 90 and epochs[35]["lr_last"] == pytest.approx(13.0)
    # half-way through the 54 decay epochs: 1e-4 + (13 - 1e-4) * 0.5 ** 2.2
    assert epochs[62]["lr_last"] == pytest.approx(END_LR + (13.0 - END_LR) * 0.5 ** 2.2)
    assert [e["augment"] for e in epochs] == [True] * 84 + [False] * 6


@pytest.mark.parametrize("preset,batch,lr,warmup,wd,momentum,epochs,span", [
    ("nvidia-mlperf40-8gpu", 3200, 11.0, 2, 5e-5, 0.9, 37, 1),
    ("nvidia-mlperf40-2528gpu", 40448, 19.4, 24, 1e-4, 0.95, 62, 2)])
def test_nvidia_mlperf_v4(preset, batch, lr, warmup, wd, momentum, epochs, span):
    r = show(preset)
    cfg = r["config"]
    assert (cfg["global_batch_size"], cfg["lr"], cfg["warmup_epochs"], cfg["weight_decay"], cfg["momentum"]) == \
        (batch, lr, warmup, wd, momentum)
    assert (len(r["epochs"]), cfg["bn_span"], cfg["target_accuracy"], cfg["lars_eta"]) == (epochs, span, 0.759, 0.001)
    assert r["epochs"][warmup - 1]["lr_last"] == pytest.approx(lr)


# the mechanisms' formulas ------------------------------------------------------------------------
def settings_of(**settings) -> Config:
    return Config(**{"lr": 3.2, "warmup_epochs": 2, **settings})


def schedule_of(clock, **settings):
    return build_lr_schedule(settings_of(**settings), clock)


def test_multistep_with_warmup_from_a_start_lr():
    s = schedule_of(EpochClock(100, 10, epochs=10), lr_schedule="multistep", warmup_start_lr=0.1,
                    lr_decay_epochs="3,6", lr_decay_factor=0.1, optimizer="sgd")
    assert s(1) == pytest.approx(0.1 + 3.1 / 20) and s(20) == pytest.approx(3.2)
    assert [s(k) for k in (21, 30, 31, 60, 61, 100)] == pytest.approx([3.2, 3.2, 0.32, 0.32, 0.032, 0.032])


def test_slow_start_phases():
    s = schedule_of(EpochClock(100, 10, epochs=8), lr_schedule="phases", lr_phases="2:0.5,3:0.1,1:0.01",
                    warmup_epochs=0)
    assert [s(k) for k in (1, 20, 21, 50, 51, 60, 61, 80)] == pytest.approx([1.6, 1.6, 0.32, 0.32, 0.032, 0.032,
                                                                            0.032, 0.032])


def test_batch_size_control_clock_and_lr():
    clock = EpochClock(100, 10, [(2, 20)], epochs=4)  # 10, 10, 5, 5 steps
    assert [clock.steps_in(e) for e in range(4)] == [10, 10, 5, 5] and clock.total_steps == 30
    assert [clock.global_batch(e) for e in range(4)] == [10, 10, 20, 20]
    assert clock.images(25) == 10 * 10 + 10 * 10 + 5 * 20 and clock.epoch_of(21) == 2 and clock.epoch_of(20) == 1
    assert clock.progress(22) == pytest.approx(2.4) and clock.steps_until(2.4) == 22
    # SGD's rule is linear in the batch: the second phase's peak is twice the first
    s = schedule_of(clock, optimizer="sgd", lr=1.0, warmup_epochs=0, lr_schedule="multistep", lr_decay_epochs="9")
    assert [s(k) for k in (1, 20, 21, 30)] == [1.0, 1.0, 2.0, 2.0]


def test_sgd_share_ramp():
    ramp = SgdShareRamp(center=10, width=5)
    assert [ramp(e) for e in (0, 7.5, 10, 12.5, 40)] == pytest.approx([0, 0, 0.5, 1, 1])
    assert ramp(8.75) == pytest.approx(0.5 - 0.5 * math.cos(math.pi / 4))


def test_augmentation_switches_off_from_the_given_epoch():
    plan = EpochPlan.of(settings_of(augment_off_epoch=8), EpochClock(100, 10, epochs=10))
    assert [plan.augment(e) for e in range(10)] == [True] * 7 + [False] * 3  # epochs 8, 9, 10 (from 1)
    assert all(EpochPlan.of(settings_of(), EpochClock(100, 10, epochs=10)).augment(e) for e in range(10))


def test_the_warmup_ramps_to_where_the_schedule_stands_at_its_end():
    """A phase or a decay step inside the warmup: the ramp ends at that LR, no jump after it."""
    clock = EpochClock(100, 10, epochs=10)  # 10 steps per epoch, warmup 2 epochs = 20 steps
    phases = schedule_of(clock, lr_schedule="phases", lr_phases="1:0.5,5:0.1")
    assert phases(20) == pytest.approx(0.32) and phases(21) == pytest.approx(0.32) and phases(10) == pytest.approx(0.16)
    steps = schedule_of(clock, lr_schedule="multistep", lr_decay_epochs="1,5", lr_decay_factor=0.1, optimizer="sgd")
    values = [steps(k) for k in range(1, 51)]
    assert values[19] == pytest.approx(0.32) and values[:20] == sorted(values[:20])
    assert values[20:] == pytest.approx([0.32] * 30) and steps(51) == pytest.approx(0.032)


def test_cosine_and_linear_decay_to_zero_after_the_warmup():
    """10 epochs of 10 steps, 2 warmup epochs: 80 decay steps from step 20 (the peak) to step 100 (0)."""
    clock = EpochClock(100, 10, epochs=10)
    cosine = schedule_of(clock, lr_schedule="cosine", optimizer="sgd")
    linear = schedule_of(clock, lr_schedule="linear", optimizer="sgd")
    for s in (cosine, linear):  # the same linear warmup from 0 to the peak
        assert [s(k) for k in (1, 10, 20)] == pytest.approx([3.2 / 20, 1.6, 3.2])
        assert s(100) == 0.0
    # a quarter, half and three quarters of the decay: cos(pi/4)... by hand, and the straight line
    quarter = 3.2 * (1 + 2 ** -0.5) / 2
    assert [cosine(k) for k in (40, 60, 80)] == pytest.approx([quarter, 1.6, 3.2 - quarter])
    assert [linear(k) for k in (40, 60, 80)] == pytest.approx([2.4, 1.6, 0.8])
    values = [cosine(k) for k in range(20, 101)]
    assert values == sorted(values, reverse=True)


def test_a_cosine_schedule_without_warmup_starts_at_the_peak():
    s = schedule_of(EpochClock(100, 10, epochs=4), lr_schedule="cosine", warmup_epochs=0, optimizer="sgd")
    assert s(1) == pytest.approx(1.6 * (1 + math.cos(math.pi / 40))) and s(20) == pytest.approx(1.6) and s(40) == 0.0
