"""Every number flag refused outside its range with one line naming it, parse errors before the rules
that combine settings, and --help that says each default once and names the presets."""
import math
from dataclasses import fields
from pathlib import Path

import pytest

from train.cli import choices, parse, parser
from train.config import Config
from train.errors import UsageError

NUMBER_FIELDS = [f for f in fields(Config) if f.type in (int, float) and not f.metadata.get("internal")]
FLOAT_FIELDS = [f for f in NUMBER_FIELDS if f.type is float]
PRESETS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "train" / "presets").glob("*.yaml"))


def flag(f) -> str:
    return "--" + f.name.replace("_", "-")


def refusal(*argv) -> str:
    with pytest.raises(UsageError) as caught:
        parse([str(a) for a in argv])
    return str(caught.value)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("field", FLOAT_FIELDS, ids=lambda f: f.name)
def test_every_float_flag_refuses_non_finite_values(field, value):
    message = refusal(f"{flag(field)}={value}")  # = : argparse would take "-inf" for a flag
    assert message.startswith(f"{flag(field)} must be a finite number") and "\n" not in message, message


@pytest.mark.parametrize("field", NUMBER_FIELDS, ids=lambda f: f.name)
def test_every_number_flag_has_a_lower_bound(field):
    """A far negative value is nonsense for every count, rate and length; the refusal names the flag."""
    message = refusal(flag(field), -10 ** 12)
    assert message.startswith(flag(field)) and "\n" not in message, message


@pytest.mark.parametrize("argv, match", [
    (["--momentum", 1.5], "--momentum must be in [0, 1), got 1.5"),
    (["--momentum", 1], "--momentum must be in [0, 1)"),
    (["--rmsprop-alpha", 1], "--rmsprop-alpha must be in [0, 1)"),
    (["--target-accuracy", 75.9], "--target-accuracy 75.9 is a percentage; give the fraction 0.759"),
    (["--target-accuracy", 5], "--target-accuracy 5 is a percentage; give the fraction 0.05"),
    (["--target-accuracy", 150], "--target-accuracy must be a fraction in (0, 1]"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--weight-decay", -1e-4], "--weight-decay must be 0 or more"),
    (["--lars-eta", 0], "--lars-eta must be more than 0"),
    (["--rmsprop-epsilon", 0], "--rmsprop-epsilon must be more than 0"),
    (["--lr-decay-factor", 2], "--lr-decay-factor must be in (0, 1]"),
    (["--max-bad-steps", 0], "--max-bad-steps must be at least 1"),
    (["--synthetic-images", 0], "--synthetic-images must be at least 1"),
    (["--seed", 2 ** 32], "--seed must be in [0, 2**32)"),
    (["--max-steps", -5, "--show-recipe"], "--max-steps must be 0 or more, got -5"),
    (["--lr-schedule", "phases", "--lr-phases", "nan:0.5"], "--lr-phases 'nan:0.5': give finite numbers"),
    (["--lr-schedule", "phases", "--lr-phases", "-1:2"], "--lr-phases '-1:2': give EPOCHS:FACTOR pairs with positive"),
    (["--image-size", 100000], "--image-size must be a crop size from 16 to 1024 px, got 100000"),
    (["--eval-image-size", 100000], "--eval-image-size must be 0 (as --image-size) or a crop size from 16 to 1024 px"),
    (["--resolution-schedule", "24:100000:0:1:8"], "END 100000 is not a crop size from 16 to 1024 px"),
])
def test_out_of_range_values_are_refused(argv, match):
    assert match in refusal(*argv)


def test_values_at_the_edges_of_their_ranges_are_accepted():
    cfg = parse(["--momentum", "0", "--target-accuracy", "1", "--weight-decay", "0", "--lr-decay-factor", "1",
                 "--seed", str(2 ** 32 - 1), "--warmup-epochs", "-1", "--target-accuracy", "0.759"])
    assert (cfg.momentum, cfg.target_accuracy, cfg.seed) == (0, 0.759, 2 ** 32 - 1)
    cfg = parse(["--image-size", "1024", "--eval-image-size", "16", "--resolution-schedule", "16:1024:0:1"])
    assert (cfg.image_size, cfg.eval_image_size, cfg.resolution_schedule) == (1024, 16, "16:1024:0:1")


def test_a_batch_change_at_or_after_the_last_epoch_is_refused():
    base = ["--preset", "nvidia-mlperf40-8gpu", "--division", "open"]  # 37 epochs
    for epoch in (50, 37):
        message = refusal(*base, "--batch-schedule", f"{epoch}:6528")
        assert f"a change after epoch {epoch} never happens in a 37-epoch run" in message, message
    assert parse([*base, "--batch-schedule", "36:6528"]).batch_schedule == "36:6528"


@pytest.mark.parametrize("preset", ["mlperf-bs3264", "nvidia-mlperf40-8gpu"])
def test_a_schedule_that_does_not_parse_says_so_before_the_closed_division_rule(preset):
    assert "--batch-schedule 'abc': 'abc' is not NUMBER:NUMBER" in refusal("--preset", preset, "--batch-schedule", "abc")
    assert "not allowed in the MLPerf closed division" in refusal("--preset", preset, "--batch-schedule", "1:4096")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_shipped_preset_is_within_the_bounds(preset):
    cfg = parse(["--preset", preset])
    assert all(math.isfinite(getattr(cfg, f.name)) for f in NUMBER_FIELDS)


def test_help_says_each_default_once_and_names_the_presets():
    actions = {a.dest: a for a in parser()._actions}
    for name, action in actions.items():  # (without the names a setting takes: --compile-mode's include torch's "default")
        assert action.help.replace(", ".join(choices().get(name, ())), "").count("default") <= 1, (name, action.help)
    assert "(default: smoke without --data-dir)" in actions["preset"].help
    help_text = " ".join(parser().format_help().split())
    assert all(f" {name}," in help_text or f" {name} " in help_text for name in PRESETS), help_text
    assert PRESETS and all(name in actions["preset"].help for name in PRESETS)
