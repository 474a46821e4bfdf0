"""Settings that derive from one another: which of a flag and a preset's related setting wins, and
the peak LR and warmup chosen from the global batch when no preset sets them."""
import math
import re

import pytest
import yaml

from helpers import read_metrics, run_train
from data.embedded import ensure_embedded
from train.cli import parse, read_command
from train.config import Config
from train.errors import UsageError
from train.batches import batch_sizes
from train.rules import lr_and_warmup, rule_lr_and_warmup


def preset(tmp_path, **settings):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(settings))
    return ["--preset", str(path)]


# --- batch sizes: a flag wins over its partner from the preset; two flags must agree -----------------
def test_a_per_rank_batch_flag_wins_over_the_presets_global_batch():
    cfg = parse(["--batch-size", "4"])  # the default `smoke` preset sets global_batch_size 64
    assert (cfg.batch_size, cfg.global_batch_size) == (4, 0)
    assert batch_sizes(cfg.batch_size, cfg.global_batch_size, 2) == (4, 8, 1)


def test_a_global_batch_flag_wins_over_the_presets_per_rank_batch(tmp_path):
    cfg = parse([*preset(tmp_path, batch_size=32), "--global-batch-size", "96"])
    assert batch_sizes(cfg.batch_size, cfg.global_batch_size, 4) == (24, 96, 1)
    assert batch_sizes(*(parse(preset(tmp_path, batch_size=32)).batch_size, 0), 4) == (32, 128, 1)


def test_two_batch_flags_must_agree_for_the_rank_count():
    cfg = parse(["--batch-size", "32", "--global-batch-size", "64"])
    assert batch_sizes(cfg.batch_size, cfg.global_batch_size, 2) == (32, 64, 1)
    assert batch_sizes(cfg.batch_size, cfg.global_batch_size, 1) == (32, 64, 2)  # two batches accumulated per step
    with pytest.raises(UsageError, match="--global-batch-size 64 is not a whole number of 3 rank.* x --batch-size 32"):
        batch_sizes(cfg.batch_size, cfg.global_batch_size, 3)


def test_neither_batch_set_means_256_per_rank_and_a_global_batch_must_divide():
    assert batch_sizes(0, 0, 3) == (256, 768, 1)
    with pytest.raises(UsageError, match="does not divide over 3 ranks"):
        batch_sizes(0, 64, 3)


def test_explicit_zero_per_rank_batch_is_refused():
    with pytest.raises(UsageError, match="--batch-size must be positive"):
        parse(["--batch-size", "0"])


# --- learning rates: --lr and --lr-per-256 ---------------------------------------------------------
def resolved_lr(argv, global_batch):
    cfg = parse(argv)
    return lr_and_warmup(cfg, global_batch)[0]


def test_an_lr_flag_wins_over_the_presets_lr_per_256(tmp_path):
    assert resolved_lr([*preset(tmp_path, lr_per_256=0.1), "--lr", "3"], 512) == 3
    assert resolved_lr(preset(tmp_path, lr_per_256=0.1), 512) == pytest.approx(0.2)


def test_an_lr_per_256_flag_wins_over_the_presets_lr():
    assert resolved_lr(["--preset", "mlperf-bs3264", "--lr-per-256", "0.5"], 3264) == pytest.approx(0.5 * 3264 / 256)
    assert resolved_lr(["--preset", "mlperf-bs3264"], 3264) == 10.5


def test_two_lr_flags_must_agree():
    assert resolved_lr(["--lr", "0.5", "--lr-per-256", "0.25"], 512) == 0.5
    with pytest.raises(UsageError, match="--lr 0.6 disagrees with --lr-per-256 0.25 x 512 / 256 = 0.5"):
        resolved_lr(["--lr", "0.6", "--lr-per-256", "0.25"], 512)


def test_flags_on_resume_win_over_the_saved_runs_partner(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"batch_size": 32, "global_batch_size": 64, "lr": 2.0,
                                                     "lr_per_256": 8.0}))
    cfg = parse(["--resume", "--out-dir", str(run), "--batch-size", "16", "--lr", "1.5"])
    assert (cfg.batch_size, cfg.global_batch_size, cfg.lr, cfg.lr_per_256) == (16, 0, 1.5, 0)
    saved, start = read_command(["--resume", "--out-dir", str(run)])
    # (the saved per-rank batch is kept where the rank count allows: start-up decides)
    assert (start.saved_batch, saved.global_batch_size, saved.lr, saved.lr_per_256) == ((32, 1), 64, 2.0, 8.0)


# --- the rule: peak LR and warmup from the global batch -------------------------------------------
# MLPerf reference convergence points (docs/learning_rate.md) and the tested smoke recipe
@pytest.mark.parametrize("batch, lr, warmup", [(1632, 7.4, 2), (3264, 10.5, 2), (8192, 17, 5), (65536, 24.699, 31),
                                               (131072, 24.699, 31), (64, 4.0, 2)])
def test_lars_rule_hits_its_anchor_points(batch, lr, warmup):
    assert rule_lr_and_warmup("lars", batch) == (pytest.approx(lr), pytest.approx(warmup))


def test_lars_rule_between_and_below_the_table():
    # halfway in log2 between 1632 and 3264 (batch 2308) lies halfway between 7.4 and 10.5
    assert rule_lr_and_warmup("lars", 2308)[0] == pytest.approx((7.4 + 10.5) / 2, abs=2e-3)
    # below the table: a power law through (64, 4.0) and (1632, 7.4)
    exponent = math.log(7.4 / 4.0) / math.log(1632 / 64)
    assert rule_lr_and_warmup("lars", 256)[0] == pytest.approx(4.0 * (256 / 64) ** exponent)
    assert rule_lr_and_warmup("lars", 16)[0] < 4.0


def test_sgd_follows_the_linear_scaling_rule():
    assert rule_lr_and_warmup("sgd", 256) == (pytest.approx(0.1), 0.0)
    assert rule_lr_and_warmup("sgd", 8192) == (pytest.approx(3.2), 5.0)


def test_warmup_never_takes_most_of_a_short_run():
    lr, warmup, note = lr_and_warmup(Config(epochs=3), 64)
    assert (lr, warmup) == (pytest.approx(4.0), pytest.approx(1.2)) and "run length" in note
    _, warmup, note = lr_and_warmup(Config(epochs=1, warmup_epochs=5, lr=1), 64)
    assert warmup == pytest.approx(0.4) and "warmup cut from 5 to 0.4 epochs" in note
    assert lr_and_warmup(Config(epochs=10, warmup_epochs=6, lr=1), 64)[1] == 6  # given and shorter: kept


@pytest.mark.slow(seconds=90)
def test_own_small_dataset_with_plain_defaults_trains_well(tmp_path):
    """A user's own dataset of 2,000 small images, ResNet-50 at 32 px, --batch-size 64 --epochs 6
    and no other tuning: the LR and warmup chosen from the batch reach what the tuned smoke run does."""
    data = ensure_embedded(seed=11, train_per_class=200, val_per_class=30, root=tmp_path / "data")
    result = run_train("--data-dir", data, "--out-dir", "run", "--image-size", 32, "--batch-size", 64,
                       "--epochs", 6, "--workers", 2, cwd=tmp_path, timeout=1200)
    assert result.returncode == 0, result.stderr
    header = result.stdout.splitlines()[0]
    assert re.search(r"lars lr 4, warmup 2 epochs \(lr from global batch 64; warmup from global batch\)", header), header
    top1 = [m["top1"] for m in read_metrics(tmp_path / "run") if m["kind"] == "eval"]
    print(f"top-1 by eval: {top1}")
    assert top1[-1] >= 0.90
