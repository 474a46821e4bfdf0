"""The scorer counts the work a run did (docs/valid_flops.md): a flipped evaluation's two forward passes,
BlurPool's blurs, and each epoch's images at the crop size its epoch record says it trained at."""
import json

import pytest
import torch
import yaml

from helpers import run_train
from models import build_model, eval_flops_per_image, train_flops_per_image
from models.resnet import BlurConv2d
from train.score.flops import images_by_size
from train.score.runs import score_run

T0 = 1_700_000_000  # run_start, s


def blur_flops(arch: str, size: int) -> int:
    """Forward FLOPs of one image's blurs, by hand: every strided convolution past the stem is blurred on
    its input, a depthwise 3x3 filter that costs 9 multiply-adds (18 FLOPs) per input value. Each padded
    stride-2 layer takes n px to ceil(n / 2): the stem and the max-pool bring the image to layer1; layer2,
    3 and 4 each open with a strided 3x3 conv and a strided 1x1 shortcut, both fed the layer before's output."""
    def half(n):
        return -(-n // 2)
    into_layer2 = half(half(size))  # after the stem and the max-pool
    sides = (into_layer2, half(into_layer2), half(half(into_layer2)))  # into layer2, 3, 4
    # channels into the blurred convs of layer2, 3, 4: (the 3x3's, the shortcut's)
    channels = {"resnet18": ((64, 64), (128, 128), (256, 256)),  # basic blocks: both see the block's input
                "resnet50": ((128, 256), (256, 512), (512, 1024))}[arch]  # bottlenecks: the 3x3 sees a 1x1's output
    return sum(18 * (conv + shortcut) * side ** 2 for (conv, shortcut), side in zip(channels, sides))


@pytest.mark.parametrize("arch, size, classes", [("resnet18", 32, 10), ("resnet18", 40, 10), ("resnet50", 224, 1000)])
def test_blurpools_count_is_the_plain_models_and_its_blurs(arch, size, classes):
    with torch.device("meta"):
        assert sum(isinstance(m, BlurConv2d) for m in build_model(arch, blurpool=True).modules()) == 6  # as counted here
    blurs = blur_flops(arch, size)
    assert eval_flops_per_image(arch, size, classes, blurpool=True) == eval_flops_per_image(arch, size, classes) + blurs
    # backward: the gradient of each blur's input costs its forward again; the filter is a constant, with no gradient
    assert train_flops_per_image(arch, size, classes, blurpool=True) == train_flops_per_image(arch, size, classes) + 2 * blurs


def hand_made_run(root, config: dict, records: list[dict]):
    """A run directory of a complete run: config.yaml, metrics.jsonl of `records` (times from T0 on, one
    second apart) and mllog.txt with its run_start, an eval_accuracy per eval record and run_stop."""
    root.mkdir()
    (root / "config.yaml").write_text(yaml.safe_dump({"arch": "resnet18", "image_size": 32, "num_classes": 10, **config}))
    records = [{**record, "time": T0 + 1 + n, "seconds": 1.0 + n} for n, record in enumerate(records)]
    (root / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    events = [("run_start", T0, None, {})]
    events += [("eval_accuracy", r["time"], r["top1"], {"epoch_num": r["epoch"]}) for r in records if r["kind"] == "eval"]
    events.append(("run_stop", records[-1]["time"], None, {"status": "success"}))
    (root / "mllog.txt").write_text("".join(
        ":::MLLOG " + json.dumps({"namespace": "", "time_ms": time * 1000, "event_type": "POINT_IN_TIME", "key": key,
                                  "value": value, "metadata": metadata}) + "\n" for key, time, value, metadata in events))
    return root


def epoch(number, images, size):
    return {"kind": "epoch", "step": images // 100, "epoch": number, "images": images, "image_size": size}


def evaluation(number, images):
    return {"kind": "eval", "epoch": number, "top1": 0.5, "top5": 0.9, "eval_images": images}


def test_a_flipped_evaluation_counts_two_forward_passes_per_evaluated_image(tmp_path):
    records = [epoch(1, 1_000, 32), evaluation(1, 300), epoch(2, 2_000, 32), evaluation(2, 300)]
    train, forward = train_flops_per_image("resnet18", 32, 10), eval_flops_per_image("resnet18", 40, 10)
    for flip, passes in ((False, 1), (True, 2)):
        run = hand_made_run(tmp_path / f"flip-{flip}", {"eval_image_size": 40, "eval_flip": flip}, records)
        scored = score_run(run, 0.763, 5, 0.759, check=False)
        assert scored.total_flop == 2_000 * train + passes * 600 * forward
    # with BlurPool too: both figures of the blurred model (its blurs by hand, as above)
    run = hand_made_run(tmp_path / "blurred", {"eval_image_size": 40, "eval_flip": True, "blurpool": True}, records)
    scored = score_run(run, 0.763, 5, 0.759, check=False)
    assert scored.total_flop == 2_000 * (train + 2 * blur_flops("resnet18", 32)) + 2 * 600 * (forward + blur_flops("resnet18", 40))


def test_a_run_resumed_with_another_ramp_is_counted_at_the_sizes_its_epoch_records_hold(tmp_path):
    # trained under 16:32:1:2:16 (16, 16, 32 px), stopped a quarter into epoch 2, resumed under 32:16:1:2:16
    # (32, 32, 16 px), which config.yaml now holds: epoch 2's first quarter was at 16 px, the rest at 32
    records = [epoch(1, 1_000, 16), evaluation(1, 300), epoch(1.25, 1_250, 16),
               {"kind": "resume", "step": 12, "epoch": 1.25, "gap_s": 5.0},
               epoch(2, 2_000, 32), evaluation(2, 300), epoch(3, 3_000, 16), evaluation(3, 300)]
    config = {"resolution_schedule": "32:16:1:2:16"}
    run = hand_made_run(tmp_path / "resumed", config, records)
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert images_by_size(config, 3_000, epochs) == {16: 2_250, 32: 750}
    per_image = {size: train_flops_per_image("resnet18", size, 10) for size in (16, 32)}
    expected = 2_250 * per_image[16] + 750 * per_image[32] + 900 * eval_flops_per_image("resnet18", 32, 10)
    assert score_run(run, 0.763, 5, 0.759, check=False).total_flop == expected


def test_records_a_resume_trained_again_and_records_without_a_size_count_by_the_settings():
    # resumed from its epoch-1 checkpoint after epoch 2's record, under 24:32:1:2:8: epoch 2 trained again at 24 px
    again = [epoch(1, 1_000, 16), epoch(2, 2_000, 16), epoch(2, 2_000, 24), epoch(3, 3_000, 32)]
    assert images_by_size({"resolution_schedule": "24:32:1:2:8"}, 3_000, again) == {16: 1_000, 24: 1_000, 32: 1_000}
    # a run from before the records held a size: each epoch at the size its settings give it
    config = {"image_size": 32, "resolution_schedule": "16:32:1:2:16"}  # 16, 16, 32 px
    older = [{key: value for key, value in record.items() if key != "image_size"} for record in again[:2]]
    assert images_by_size(config, 2_000, older) == {16: 2_000}
    # a crashed run's steps after its last record (counted from its train records): that epoch's size
    assert images_by_size(config, 2_400, older) == {16: 2_000, 32: 400}
    assert images_by_size(config, 700, []) == {16: 700}


@pytest.mark.slow(seconds=15)
def test_a_real_run_with_flips_blurpool_and_a_changed_ramp_is_counted_as_it_ran(tmp_path):
    flags = ["--loader", "synthetic", "--synthetic-images", 64, "--synthetic-val-images", 32, "--synthetic-classes", 4,
             "--arch", "resnet18", "--image-size", 32, "--eval-image-size", 24, "--eval-flip", "--blurpool",
             "--global-batch-size", 16, "--epochs", 3, "--eval-every", 1, "--workers", 1, "--out-dir", "run"]
    first = run_train(*flags, "--resolution-schedule", "16:32:1:2:16", "--max-steps", 4, cwd=tmp_path)  # epoch 1, 16 px
    assert first.returncode == 0, first.stderr
    second = run_train(*flags, "--resolution-schedule", "32:16:1:2:16", "--resume", "--max-steps", 0, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["images"], r["image_size"]) for r in records if r["kind"] == "epoch"] == [(64, 16), (128, 32), (192, 16)]
    assert sum(r["eval_images"] for r in records if r["kind"] == "eval") == 96
    train = {size: train_flops_per_image("resnet18", size, 4, blurpool=True) for size in (16, 32)}
    expected = 128 * train[16] + 64 * train[32] + 2 * 96 * eval_flops_per_image("resnet18", 24, 4, blurpool=True)
    assert score_run(run, 0.763, 5, 0.759, check=False).total_flop == expected


def test_each_evaluation_counts_at_the_size_and_flips_its_record_holds(tmp_path):
    # config.yaml holds the settings of the last start (40 px, flipped); the first evaluation ran at 24 px
    # unflipped, the second as config.yaml says, the third's record (a run from before records held them) says nothing
    records = [epoch(1, 1_000, 32), {**evaluation(1, 300), "eval_image_size": 24, "eval_flip": False},
               epoch(2, 2_000, 32), {**evaluation(2, 300), "eval_image_size": 40, "eval_flip": True},
               epoch(3, 3_000, 32), evaluation(3, 300)]
    run = hand_made_run(tmp_path / "run", {"eval_image_size": 40, "eval_flip": True}, records)
    forward = {size: eval_flops_per_image("resnet18", size, 10) for size in (24, 40)}
    expected = 3_000 * train_flops_per_image("resnet18", 32, 10) + 300 * forward[24] + 2 * 2 * 300 * forward[40]
    assert score_run(run, 0.763, 5, 0.759, check=False).total_flop == expected


def test_a_resume_from_a_checkpoint_before_a_stop_record_drops_what_it_trains_again():
    # stopped a quarter into epoch 2 (its record: 1,250 images at 16 px) without that checkpoint reaching the
    # disk; resumed from the epoch-1 checkpoint (step 10) under another ramp, epoch 2 trained again, at 32 px
    records = [epoch(1, 1_000, 16), epoch(1.25, 1_250, 16), {"kind": "resume", "step": 10, "epoch": 1.0},
               epoch(2, 2_000, 32)]
    assert images_by_size({"resolution_schedule": "32:16:1:2:16"}, 2_000, records) == {16: 1_000, 32: 1_000}
    # resumed from the stop's own checkpoint: nothing is trained again
    records[2] = {"kind": "resume", "step": 12, "epoch": 1.25}
    assert images_by_size({"resolution_schedule": "32:16:1:2:16"}, 2_000, records) == {16: 1_250, 32: 750}


@pytest.mark.slow(seconds=8)
def test_a_real_run_that_turns_flips_on_at_a_resume_counts_its_evaluations_as_they_ran(tmp_path):
    flags = ["--loader", "synthetic", "--synthetic-images", 64, "--synthetic-val-images", 32, "--synthetic-classes", 4,
             "--arch", "resnet18", "--image-size", 32, "--global-batch-size", 16, "--epochs", 2, "--eval-every", 1,
             "--workers", 1, "--out-dir", "run"]
    first = run_train(*flags, "--eval-image-size", 24, "--max-steps", 4, cwd=tmp_path)  # epoch 1 and its evaluation
    assert first.returncode == 0, first.stderr
    second = run_train(*flags, "--resume", "--eval-image-size", 40, "--eval-flip", "--max-steps", 0, cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    run = tmp_path / "run"
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["eval_images"], r["eval_image_size"], r["eval_flip"]) for r in records if r["kind"] == "eval"] == [
        (32, 24, False), (32, 40, True)]
    assert yaml.safe_load((run / "config.yaml").read_text())["eval_flip"] is True  # today's settings only
    forward = {size: eval_flops_per_image("resnet18", size, 4) for size in (24, 40)}
    expected = 128 * train_flops_per_image("resnet18", 32, 4) + 32 * forward[24] + 2 * 32 * forward[40]
    assert score_run(run, 0.763, 5, 0.759, check=False).total_flop == expected
