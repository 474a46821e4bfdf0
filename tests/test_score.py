"""The scorer on hand-made run directories (known times and accuracies) and on real runs."""
import json
import os
import shutil
import signal
import struct
import sys

import pytest
import yaml

from helpers import run_module, run_train
from models import eval_flops_per_image, train_flops_per_image

T0 = 1_700_000_000_000  # run_start, ms


def mllog_line(key, time_ms, value=None, **metadata):
    return ":::MLLOG " + json.dumps({"namespace": "", "time_ms": time_ms, "event_type": "POINT_IN_TIME", "key": key,
                                     "value": value, "metadata": metadata})


def make_run(root, name, evals, stop_s=None, images=1_000_000, eval_images=50_000, status="success", config=None):
    """evals: [(seconds after run_start, top1)]."""
    run = root / name
    run.mkdir()
    lines = [mllog_line("run_start", T0)]
    for epoch, (seconds, top1) in enumerate(evals, start=1):
        lines.append(mllog_line("eval_accuracy", T0 + int(seconds * 1000), top1, epoch_num=epoch))
    if stop_s is not None:
        lines.append(mllog_line("run_stop", T0 + int(stop_s * 1000), None, status=status))
    (run / "mllog.txt").write_text("\n".join(lines) + "\n")
    last = T0 / 1000 + evals[-1][0]
    metrics = [{"kind": "train", "step": 10, "images": images, "seconds": evals[-1][0], "img_per_s": 1.0, "time": last - 1},
               {"kind": "eval", "epoch": len(evals), "top1": evals[-1][1], "eval_images": eval_images, "seconds": evals[-1][0],
                "time": last}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "config.yaml").write_text(yaml.safe_dump(config or {"arch": "resnet50", "image_size": 224,
                                                             "data_dir": "/imagenet", "global_batch_size": 3264,
                                                             "preset": "mlperf-bs3264", "optimizer": "lars", "lr": 10.5,
                                                             "warmup_epochs": 2.0, "weight_decay": 5e-5, "momentum": 0.9,
                                                             "label_smoothing": 0.1, "epochs": 37}))
    return run


def score(*args, cwd):
    return run_module("train.score", *args, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_valid_flops_arithmetic_on_a_hand_made_log(tmp_path):
    make_run(tmp_path, "run", [(1000.0, 0.70), (1800.0, 0.765)], stop_s=2000.0)
    result = score(tmp_path / "run", "--json", "--no-check", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    per_image = train_flops_per_image("resnet50", 224, 1000)
    assert abs(per_image - 24.3e9) / 24.3e9 < 0.02
    total = 1_000_000 * per_image + 50_000 * eval_flops_per_image("resnet50", 224, 1000)
    flops = total / 2000.0
    assert got["time_to_quality_s"] == pytest.approx(2000.0)
    assert got["time_to_target_s"] == pytest.approx(1800.0)  # first eval at or above 75.9%
    assert got["total_flop"] == pytest.approx(total) and got["flops"] == pytest.approx(flops)
    assert got["valid_flops"] == pytest.approx(flops * (0.765 / 0.763) ** 5)
    assert got["top1"] == 0.765 and got["throughput_img_s"] == pytest.approx(500.0)
    assert got["hpc_ai500_level"] == "hardware"
    other = score(tmp_path / "run", "--json", "--no-check", "--target", 0.8, "--power", 10, cwd=tmp_path)
    assert json.loads(other.stdout)["valid_flops"] == pytest.approx(flops * (0.765 / 0.8) ** 10)


@pytest.mark.slow
def test_the_class_count_a_run_recorded_is_used_and_older_runs_are_guessed(tmp_path):
    # A run from before runs recorded num_classes: the embedded dataset (no data_dir), so ten classes.
    old = make_run(tmp_path, "old", [(100, 0.5)], stop_s=100, images=20_000, eval_images=3_000,
                   config={"arch": "resnet18", "image_size": 32, "data_dir": "", "loader": "torch"})
    runs = {}
    for name, classes in (("recorded", 100), ("zero", 0)):  # 0: nothing recorded, guessed as before
        runs[name] = tmp_path / name
        shutil.copytree(old, runs[name])
        config = yaml.safe_load((old / "config.yaml").read_text())
        (runs[name] / "config.yaml").write_text(yaml.safe_dump({**config, "num_classes": classes}))
    got = {name: json.loads(score(run, "--json", "--no-check", cwd=tmp_path).stdout)
           for name, run in {"old": old, **runs}.items()}
    ten = 20_000 * train_flops_per_image("resnet18", 32, 10) + 3_000 * eval_flops_per_image("resnet18", 32, 10)
    assert got["old"]["total_flop"] == got["zero"]["total_flop"] == ten
    difference = (20_000 * (train_flops_per_image("resnet18", 32, 100) - train_flops_per_image("resnet18", 32, 10))
                  + 3_000 * (eval_flops_per_image("resnet18", 32, 100) - eval_flops_per_image("resnet18", 32, 10)))
    assert difference > 0
    assert got["recorded"]["total_flop"] - got["old"]["total_flop"] == difference
    assert got["recorded"]["flops"] == pytest.approx((ten + difference) / 100.0)


@pytest.mark.slow
def test_olympic_mean_with_and_without_a_run_that_missed_the_target(tmp_path):
    for i, t in enumerate([100, 90, 130, 110, 120]):
        make_run(tmp_path, f"ok{i}", [(t, 0.76)], stop_s=t)
    five = json.loads(score(*[tmp_path / f"ok{i}" for i in range(5)], "--json", "--no-check", cwd=tmp_path).stdout)
    assert five["mlperf"] == {"valid": True, "score_s": pytest.approx((100 + 110 + 120) / 3), "runs": 5, "averaged": 3}
    make_run(tmp_path, "missed", [(80, 0.70)], stop_s=80, status="aborted")
    runs = [tmp_path / f"ok{i}" for i in range(4)] + [tmp_path / "missed"]
    one_failed = json.loads(score(*runs, "--json", "--no-check", cwd=tmp_path).stdout)["mlperf"]
    assert one_failed["valid"] and one_failed["score_s"] == pytest.approx((100 + 110 + 130) / 3)  # failed = dropped slowest
    make_run(tmp_path, "missed2", [(85, 0.71)], stop_s=85, status="aborted")
    two_failed = score(*runs, tmp_path / "missed2", cwd=tmp_path, )
    assert "MLPerf score: invalid" in two_failed.stdout and "never reached" in two_failed.stdout


def test_runs_of_different_configurations_get_no_mlperf_score(tmp_path):
    make_run(tmp_path, "a", [(100, 0.76)], stop_s=100)
    make_run(tmp_path, "b", [(100, 0.76)], stop_s=100, config={"arch": "resnet50", "image_size": 224, "lr": 3.0})
    make_run(tmp_path, "c", [(100, 0.76)], stop_s=100)
    result = score(tmp_path / "a", tmp_path / "b", tmp_path / "c", "--no-check", cwd=tmp_path)
    assert result.returncode == 0 and "different configurations" in result.stdout


@pytest.mark.slow
def test_published_result_against_hand_arithmetic(tmp_path):
    result = score("--time-s", 74.7, "--top1", 0.7508, "--epochs", 90, "--json", cwd=tmp_path)  # Yamazaki et al. 2019
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    images = 115_305_030  # 90 epochs x 1,281,167 ImageNet training images
    assert 90 * 1_281_167 == images
    # ResNet-50 at 224 px, forward + backward, multiply-add = 2 FLOPs: 24.3 GFLOP per image as
    # torch.utils.flop_counter counts it (torch 2.14.1); the scorer counts it itself, hence the 2%.
    total = images * 24.3e9
    flops = total / 74.7
    assert got["images"] == images and got["throughput_img_s"] == round(images / 74.7, 2)
    assert got["time_to_quality_s"] == 74.7 and got["top1"] == 0.7508
    assert abs(got["total_flop"] - total) / total < 0.02
    assert abs(got["flops"] - flops) / flops < 0.02
    valid = flops * (0.7508 / 0.763) ** 5
    assert abs(got["valid_flops"] - valid) / valid < 0.02
    # The accuracy factor does not depend on the FLOP count, so it can be held much tighter.
    assert got["valid_flops"] / got["flops"] == pytest.approx((0.7508 / 0.763) ** 5, rel=1e-9)
    bad = score("--time-s", 0, "--top1", 0.75, cwd=tmp_path)
    assert bad.returncode == 2 and "--time-s must be positive" in bad.stderr


def trainer_config(*flags):
    """The config.yaml the trainer writes for these flags."""
    from train.cli import parse
    from train.config import to_dict
    return yaml.safe_load(yaml.safe_dump(to_dict(parse(["--data-dir", "/imagenet", *flags]))))


def test_unchanged_reference_preset_is_hardware_level():
    from train.score import hpc_ai500_level
    level, reason = hpc_ai500_level(trainer_config("--preset", "mlperf-bs3264"))
    assert level == "hardware" and "mlperf-bs3264 unchanged" in reason
    # runs from before some keys were saved: what is not there was not changed
    older = {k: v for k, v in trainer_config("--preset", "mlperf-bs3264").items()
             if k not in ("epochs", "end_lr", "lr_decay_power", "lars_eta", "lars_epsilon")}
    assert hpc_ai500_level(older)[0] == "hardware"


@pytest.mark.parametrize("key, value", [("epochs", 40), ("end_lr", 1e-3), ("lars_eta", 0.002),
                                        ("lr_decay_power", 1.0), ("lars_epsilon", 1e-9), ("lr", 11.0),
                                        ("bn_group_size", 32), ("augment_off_epoch", 30),
                                        ("lr_schedule", "multistep")])
def test_changed_hyperparameter_of_a_reference_preset_is_system_level(key, value):
    from train.score import hpc_ai500_level
    open_division = ["--division", "open"] if key == "lr_schedule" else []  # (the closed division refuses it)
    config = trainer_config("--preset", "mlperf-bs3264", *open_division, "--" + key.replace("_", "-"), str(value))
    level, reason = hpc_ai500_level(config)
    assert level == "system" and reason.startswith(f"mlperf-bs3264 with {key} changed"), reason


def test_keys_a_preset_leaves_out_are_compared_with_the_trainer_defaults(tmp_path, monkeypatch):
    from train.score import hpc_ai500_level
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mlperf-bs256.yaml").write_text("arch: resnet50\nimage_size: 224\nglobal_batch_size: 256\n")
    config = {"arch": "resnet50", "image_size": 224, "global_batch_size": 256, "preset": "mlperf-bs256.yaml",
              "epochs": 90, "end_lr": 1e-4, "lars_eta": 0.001}  # the trainer's defaults
    assert hpc_ai500_level(config)[0] == "hardware"
    level, reason = hpc_ai500_level({**config, "end_lr": 0.0, "lars_eta": 0.02})
    assert level == "system" and "end_lr, lars_eta changed" in reason


@pytest.mark.slow
def test_system_level_on_a_scored_run(tmp_path):
    changed = make_run(tmp_path, "changed", [(100, 0.76)], stop_s=100,
                       config={**trainer_config("--preset", "mlperf-bs3264"), "lars_eta": 0.002})
    result = score(changed, "--no-check", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "changed: HPC AI500 level system: mlperf-bs3264 with lars_eta changed" in result.stdout
    own = make_run(tmp_path, "own", [(100, 0.76)], stop_s=100, config=trainer_config("--global-batch-size", "2048"))
    got = json.loads(score(own, "--json", "--no-check", cwd=tmp_path).stdout)
    assert got["hpc_ai500_level"] == "system" and "no reference recipe preset" in got["level_reason"]


@pytest.mark.slow
def test_crashed_truncated_and_unevaluated_runs(tmp_path):
    crashed = make_run(tmp_path, "crashed", [(100, 0.5), (200, 0.6)])  # no run_stop
    with open(crashed / "mllog.txt", "a") as f:
        f.write(':::MLLOG {"namespace": "", "time_ms": 17000')  # a last line cut off mid-write
    got = json.loads(score(crashed, "--json", "--no-check", cwd=tmp_path).stdout)
    assert got["status"] == "crashed" and got["time_to_quality_s"] == pytest.approx(200.0) and got["top1"] == 0.6
    assert any("cut off" in n for n in got["notes"]) and any("crashed" in n for n in got["notes"])
    never = tmp_path / "never"
    never.mkdir()
    (never / "mllog.txt").write_text(mllog_line("run_start", T0) + "\n" + mllog_line("run_stop", T0 + 5000, status="aborted") + "\n")
    result = score(never, cwd=tmp_path)
    assert result.returncode == 2 and "never evaluated" in result.stderr
    both = score(never, crashed, "--no-check", cwd=tmp_path)  # something can be scored: exit 0 with a warning
    assert both.returncode == 0 and "never evaluated" in both.stderr and "crashed" in both.stdout
    (tmp_path / "empty").mkdir()
    empty = score(tmp_path / "empty", cwd=tmp_path)
    assert empty.returncode == 2 and "no mllog.txt" in empty.stderr
    backwards = make_run(tmp_path, "backwards", [(-5, 0.5)], stop_s=-1)
    assert "not after run_start" in score(backwards, cwd=tmp_path).stderr


@pytest.mark.slow
def test_compliance_verdict_and_report_on_real_runs(tmp_path):
    # One epoch trained in full: a run that ended by itself gets the checker's verdict. Run a's --max-steps is
    # its epoch's steps: reached as the epoch ends, it cut nothing short.
    for name, max_steps in (("a", 15), ("b", 0)):
        trained = run_train("--out-dir", name, "--arch", "resnet18", "--epochs", 1, "--max-steps", max_steps,
                            "--workers", 0, "--log-every", 5, cwd=tmp_path)
        assert trained.returncode == 0, trained.stderr
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert steps_per_epoch(tmp_path / "a") == 15 and max(m.get("step", 0) for m in records) == 15
    lines = (tmp_path / "b" / "mllog.txt").read_text().splitlines()  # break it: drop a required key
    (tmp_path / "b" / "mllog.txt").write_text("".join(f"{line}\n" for line in lines if '"key": "submission_org"' not in line))
    good = json.loads(score(tmp_path / "a", "--json", cwd=tmp_path).stdout)
    assert good["status"] == "complete"
    assert good["mlperf_compliant"] is True and good["mlperf_verdict"] == "SUCCESS"
    assert good["hpc_ai500_level"] == "free"  # resnet18 at 32 px: the model changed
    broken = json.loads(score(tmp_path / "b", "--json", cwd=tmp_path).stdout)
    assert broken["mlperf_compliant"] is False and "submission_org" in broken["mlperf_verdict"], broken["mlperf_verdict"]
    result = score(tmp_path / "a", tmp_path / "b", "--no-check", "--report", tmp_path / "report.png", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    png = (tmp_path / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1200, 450)
    assert not (tmp_path / "compliance_checker.log").exists()


@pytest.fixture(scope="module")
def max_steps_run(tmp_path_factory):
    """A real default-preset run (ResNet-18) stopped by --max-steps after 3 of its 16 epochs' steps; it
    evaluates there, and its log ends with run_stop status success."""
    root = tmp_path_factory.mktemp("max_steps")
    trained = run_train("--out-dir", "cut", "--arch", "resnet18", "--max-steps", 3, "--workers", 0, "--log-every", 1,
                        cwd=root)
    assert trained.returncode == 0, trained.stderr
    return root / "cut"


def steps_per_epoch(run):
    """The run's steps per epoch: its training images (mllog's train_samples) // its global batch."""
    events = [json.loads(line.split(" ", 1)[1]) for line in (run / "mllog.txt").read_text().splitlines()]
    train_images = next(e["value"] for e in events if e["key"] == "train_samples")
    return train_images // yaml.safe_load((run / "config.yaml").read_text())["global_batch_size"]


@pytest.mark.slow
def test_a_run_stopped_by_max_steps_says_so_and_gets_no_verdict(max_steps_run, tmp_path):
    from helpers import compliance
    config = yaml.safe_load((max_steps_run / "config.yaml").read_text())
    assert config["max_steps"] == 3 and config["epochs"] == 16
    # the checker passes the log (open division, run_stop success): the scorer must not pass it on
    checked = compliance(max_steps_run / "mllog.txt", cwd=tmp_path)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout + checked.stderr
    got = json.loads(score(max_steps_run, "--json", cwd=tmp_path).stdout)
    assert got["status"] == "stopped at max-steps"
    assert got["mlperf_compliant"] is None
    assert f"3 of {16 * steps_per_epoch(max_steps_run)} steps" in got["mlperf_verdict"], got["mlperf_verdict"]
    rows = score(max_steps_run, cwd=tmp_path).stdout.splitlines()
    assert rows[1].split("  ")[1].strip() == "stopped at max-steps" and " - " in rows[1] and "SUCCESS" not in rows[1]
    assert any(row.startswith("cut: MLPerf: no verdict: stopped at max-steps") for row in rows)


@pytest.mark.slow
def test_a_running_run_is_running_a_preempted_one_preempted_and_resumable_not_crashed(tmp_path):
    from helpers import kill_tree, start, wait_until
    from train import checkpoint
    command = [sys.executable, "-m", "train", "--out-dir", "run", "--arch", "resnet18", "--epochs", 30, "--workers", 0,
               "--log-every", 1]
    proc = start(command, cwd=tmp_path, log=tmp_path / "train.log")
    try:  # stopped as Slurm stops a job, once its first evaluation is logged
        metrics = tmp_path / "run" / "metrics.jsonl"
        wait_until(lambda: metrics.exists() and '"kind": "eval"' in metrics.read_text(), 300, "an eval", alive=[proc])
        running = json.loads(score(tmp_path / "run", "--json", "--no-check", cwd=tmp_path).stdout)
        assert running["status"] == "running" and f"process {proc.pid} on" in " ".join(running["notes"])  # its lock
        os.kill(proc.pid, signal.SIGUSR1)
        assert proc.wait(timeout=120) == 75, (tmp_path / "train.log").read_text()
    finally:
        kill_tree(proc)
    run = tmp_path / "run"
    step = checkpoint.peek(run / "checkpoint.pt")["step"]
    got = json.loads(score(run, "--json", cwd=tmp_path).stdout)
    assert got["status"] == "preempted" and got["mlperf_compliant"] is None
    assert f"preempted at step {step}" in got["mlperf_verdict"]
    assert any(f"preempted at step {step}: resumable" in note and "checkpoint.pt" in note for note in got["notes"])
    assert not any("crashed" in note for note in got["notes"])
    # what tells it from a crash is the PREEMPTED marker beside its checkpoint
    crashed = tmp_path / "crashed"
    shutil.copytree(run, crashed)
    (crashed / "PREEMPTED").unlink()
    got = json.loads(score(crashed, "--json", cwd=tmp_path).stdout)
    assert got["status"] == "crashed" and got["mlperf_compliant"] is None and "crashed" in got["mlperf_verdict"]


@pytest.mark.slow
def test_each_problem_is_said_once_and_a_missing_path_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    result = score("runs/x", "empty", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == "error: runs/x does not exist; empty holds no mllog.txt or metrics.jsonl; is it a run directory?\n"
    make_run(tmp_path, "good", [(100, 0.76)], stop_s=100)
    partly = score("runs/x", "good", "--no-check", cwd=tmp_path)
    assert partly.returncode == 0 and partly.stderr == "warning: runs/x does not exist\n"


def write_metrics(run, records):
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in records))


def test_throughput_of_a_run_shorter_than_a_logging_window_is_drawn_from_its_epoch_records(tmp_path):
    from train.score import read_metrics, report_figure, score_run, throughput_series
    t0 = T0 / 1000
    short = make_run(tmp_path, "short", [(100, 0.5), (200, 0.6)], stop_s=200, images=20_000)
    write_metrics(short, [{"kind": "epoch", "step": 5, "epoch": 1, "images": 10_000, "seconds": 90.0, "img_per_s": 111.1,
                           "time": t0 + 90},
                          {"kind": "eval", "epoch": 1, "top1": 0.5, "eval_images": 100, "seconds": 100.0, "time": t0 + 100},
                          {"kind": "epoch", "step": 10, "epoch": 2, "images": 20_000, "seconds": 190.0,
                           "img_per_s": 111.1, "time": t0 + 190},
                          {"kind": "eval", "epoch": 2, "top1": 0.6, "eval_images": 100, "seconds": 200.0, "time": t0 + 200}])
    bare = make_run(tmp_path, "bare", [(100, 0.5)], stop_s=100)
    write_metrics(bare, [{"kind": "eval", "epoch": 1, "top1": 0.5, "eval_images": 100, "seconds": 100.0, "time": t0 + 100}])
    assert throughput_series(read_metrics(short, [])) == ([[(90.0, 111.1), (190.0, 111.1)]], [])
    assert throughput_series(read_metrics(bare, [])) == ([], [])
    scores = [score_run(run, 0.763, 5, 0.759, check=False) for run in (short, bare)]
    assert scores[0].throughput_img_s == pytest.approx(100.0)  # 20,000 images in 200 s, as the table says
    figure = report_figure(scores, 0.759)
    throughput = figure.axes[0]
    drawn = [line for line in throughput.get_lines() if line.get_label() == "short"]
    assert len(drawn) == 1 and list(drawn[0].get_xdata()[:2]) == [90.0, 190.0]
    assert [text.get_text() for text in throughput.get_legend().get_texts()] == ["short"]  # none for bare


def resumed_run(root, stop=True, first_stop=None):
    """Trained 1,200 s, down 1,000 s, trained 800 s more: 1,000,000 images in 2,000 s of training, 3,000 s of wall time.
    The first segment ends without run_stop (preempted) or, given first_stop, with one of that status."""
    run = make_run(root, "resumed", [(1000, 0.70)])
    lines = [mllog_line("run_start", T0), mllog_line("eval_accuracy", T0 + 1_000_000, 0.70, epoch_num=1)]
    if first_stop:
        lines.append(mllog_line("run_stop", T0 + 1_200_000, status=first_stop))
    lines += [mllog_line("run_start", T0 + 2_200_000),  # back at 2,200 s
              mllog_line("eval_accuracy", T0 + 2_900_000, 0.765, epoch_num=2)]
    if stop:
        lines.append(mllog_line("run_stop", T0 + 3_000_000, status="success"))
    (run / "mllog.txt").write_text("\n".join(lines) + "\n")
    t0 = T0 / 1000
    write_metrics(run, [
        {"kind": "train", "step": 100, "images": 300_000, "seconds": 600.0, "img_per_s": 500.0, "time": t0 + 600},
        {"kind": "epoch", "step": 167, "images": 500_000, "seconds": 1000.0, "img_per_s": 500.0, "time": t0 + 1000},
        {"kind": "eval", "epoch": 1, "top1": 0.70, "eval_images": 50_000, "seconds": 1000.0, "time": t0 + 1000},
        {"kind": "train", "step": 200, "images": 600_000, "seconds": 1200.0, "img_per_s": 500.0, "time": t0 + 1200},
        {"kind": "resume", "step": 200, "epoch": 1.2, "seconds": 1200.0, "gap_s": 1000.0, "time": t0 + 2200},
        {"kind": "train", "step": 300, "images": 900_000, "seconds": 1800.0, "img_per_s": 500.0, "time": t0 + 2800},
        {"kind": "eval", "epoch": 2, "top1": 0.765, "eval_images": 50_000, "seconds": 1900.0, "time": t0 + 2900},
        {"kind": "epoch", "step": 334, "images": 1_000_000, "seconds": 2000.0, "img_per_s": 500.0, "time": t0 + 3000}])
    return run


@pytest.mark.slow
def test_a_resumed_run_is_measured_in_training_time(tmp_path):
    run = resumed_run(tmp_path)
    result = score(run, "--json", "--no-check", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["wall_time_s"] == pytest.approx(3000.0) and got["training_time_s"] == pytest.approx(2000.0)
    assert got["time_to_quality_s"] == pytest.approx(2000.0)
    assert got["time_to_target_s"] == pytest.approx(1900.0)  # the eval at 2,900 s of wall time, 1,000 s of it down
    assert got["throughput_img_s"] == pytest.approx(500.0)  # not 1,000,000 / 3,000 = 333
    total = 1_000_000 * train_flops_per_image("resnet50", 224, 1000) + 100_000 * eval_flops_per_image("resnet50", 224, 1000)
    assert got["flops"] == pytest.approx(total / 2000.0)
    assert got["status"] == "complete, resumed 1x"
    assert any("training time" in note for note in got["notes"])
    table = score(run, "--no-check", cwd=tmp_path).stdout
    assert "wall s" in table.splitlines()[0] and "3000.0" in table and "2000.0" in table
    (tmp_path / "crashed").mkdir()
    # aborted (a non-finite loss), resumed, then crashed: the last segment's end is the run's end
    crashed = resumed_run(tmp_path / "crashed", stop=False, first_stop="aborted")
    got = json.loads(score(crashed, "--json", "--no-check", cwd=tmp_path).stdout)
    assert got["status"] == "crashed, resumed 1x"  # scored up to its last eval: 2,900 s of wall time
    assert got["wall_time_s"] == pytest.approx(2900.0) and got["training_time_s"] == pytest.approx(1900.0)


def test_a_resumed_run_is_drawn_in_segments_with_each_resume_marked(tmp_path):
    from train.score import read_metrics, report_figure, score_run, throughput_series
    run = resumed_run(tmp_path)
    segments, resumes = throughput_series(read_metrics(run, []))
    assert segments == [[(600.0, 500.0), (1200.0, 500.0)], [(1800.0, 500.0)]] and resumes == [1200.0]
    throughput = report_figure([score_run(run, 0.763, 5, 0.759, check=False)], 0.759).axes[0]
    dotted = [line for line in throughput.get_lines() if line.get_linestyle() == ":"]
    assert len(dotted) == 1 and list(dotted[0].get_xdata()) == [1200.0, 1200.0]
    seconds = [x for x in throughput.get_lines()[0].get_xdata() if x == x]  # NaN breaks the line at the resume
    assert seconds == sorted(seconds) == [600.0, 1200.0, 1800.0]


def test_evaluations_are_drawn_at_the_fractional_epoch_they_were_taken(max_steps_run):
    from train.score import report_figure, score_run
    accuracy = report_figure([score_run(max_steps_run, 0.763, 5, 0.759, check=False)], 0.759).axes[1]
    drawn = [line for line in accuracy.get_lines() if line.get_label() == "cut"]
    # the eval after 3 steps is 3 steps into epoch 1 (MLLOG and the eval record call it epoch 1)
    assert len(drawn) == 1 and list(drawn[0].get_xdata()) == pytest.approx([3 / steps_per_epoch(max_steps_run)])


def pixels_of(figure, axis, colour) -> int:
    """How many pixels inside the axis's panel, as the figure is drawn, show exactly `colour` (the
    legend, which shows every run's style whether its data show or not, left out)."""
    import numpy as np
    from matplotlib.colors import to_rgb
    for panel in figure.axes:
        panel.get_legend().set_visible(False)
    figure.canvas.draw()
    image = np.asarray(figure.canvas.buffer_rgba())[..., :3]
    box = axis.get_window_extent()
    panel = image[int(image.shape[0] - box.y1):int(image.shape[0] - box.y0), int(box.x0):int(box.x1)]
    return int((panel == np.round(np.array(to_rgb(colour)) * 255)).all(axis=-1).sum())


def test_runs_that_coincide_all_show_in_the_picture(max_steps_run, tmp_path):
    from train.score import report_figure, score_run
    twin = tmp_path / "twin"  # the same run twice: every point of one lies on the other's
    shutil.copytree(max_steps_run, twin)
    figure = report_figure([score_run(run, 0.763, 5, 0.759, check=False) for run in (max_steps_run, twin)], 0.759)
    for axis in figure.axes:
        lines = {line.get_label(): line for line in axis.get_lines()}
        assert lines["cut"].get_color() != lines["twin"].get_color()
        for name in ("cut", "twin"):
            assert pixels_of(figure, axis, lines[name].get_color()) >= 10, (axis.get_title(), name)


def test_a_long_run_does_not_squash_a_short_one(tmp_path):
    """A run of 3 steps (3 s, its eval at epoch 0.2) beside one of 16 epochs (1,600 s)."""
    from train.score import report_figure, score_run
    t0 = T0 / 1000
    short = make_run(tmp_path, "short", [(3, 0.2)], stop_s=3, images=192)
    write_metrics(short, [{"kind": "train", "step": step, "epoch": step / 15, "images": 64 * step,
                           "seconds": float(step), "img_per_s": 64.0, "time": t0 + step} for step in (1, 2, 3)]
                  + [{"kind": "eval", "step": 3, "epoch": 1, "top1": 0.2, "eval_images": 100, "seconds": 3.0,
                      "time": t0 + 3}])
    long = make_run(tmp_path, "long", [(1600, 0.9)], stop_s=1600, images=15_360)
    records = []
    for epoch in range(1, 17):
        records += [{"kind": "epoch", "step": 15 * epoch, "epoch": epoch, "images": 960 * epoch,
                     "seconds": 100.0 * epoch, "img_per_s": 9.6, "time": t0 + 100 * epoch},
                    {"kind": "eval", "step": 15 * epoch, "epoch": epoch, "top1": 0.05 * epoch, "eval_images": 100,
                     "seconds": 100.0 * epoch, "time": t0 + 100 * epoch}]
    write_metrics(long, records)
    throughput, accuracy = report_figure([score_run(run, 0.763, 5, 0.759, check=False) for run in (short, long)],
                                         0.759).axes

    def pixel_x(axis, name):
        """The display x of each point of the named run's line."""
        line = [line for line in axis.get_lines() if line.get_label() == name][0]
        return [axis.transData.transform((x, 0.5))[0] for x in line.get_xdata() if x == x]

    short_seconds = pixel_x(throughput, "short")
    assert max(short_seconds) - min(short_seconds) >= 0.1 * throughput.bbox.width  # its 3 points spread out
    # its eval (epoch 0.2) stands apart from the long run's first (epoch 1)
    assert pixel_x(accuracy, "long")[0] - pixel_x(accuracy, "short")[0] >= 0.1 * accuracy.bbox.width


@pytest.fixture(scope="module")
def complete_run(tmp_path_factory):
    """A real run of two epochs trained in full, its global batch halved for the second (--batch-schedule),
    evaluated after each; its log ends with run_stop status success."""
    root = tmp_path_factory.mktemp("complete")
    trained = run_train("--out-dir", "done", "--arch", "resnet18", "--epochs", 2, "--batch-schedule", "1:32",
                        "--workers", 0, "--log-every", 5, cwd=root)
    assert trained.returncode == 0, trained.stderr
    return root / "done"


@pytest.fixture(scope="module")
def resumed_run_real(tmp_path_factory):
    """A real run of two epochs stopped by --max-steps after the first, then resumed to its end: two
    segments in one mllog.txt, and it completed."""
    root = tmp_path_factory.mktemp("resumed")
    for flags in (("--arch", "resnet18", "--epochs", 2, "--max-steps", 15), ("--resume", "--max-steps", 0)):
        trained = run_train("--out-dir", "again", *flags, "--workers", 0, "--log-every", 5, cwd=root)
        assert trained.returncode == 0, trained.stderr
    return root / "again"


def copy_without(run, name, tmp_path):
    """A copy of the run directory, of the same name, in tmp_path, without its file `name`."""
    copy = tmp_path / run.name
    shutil.copytree(run, copy)
    (copy / name).unlink()
    return copy


def error_line(result, *words):
    """The scorer refused: exit 2 and one `error:` line on stderr that says each of words."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert all(word in lines[0] for word in words), lines[0]


@pytest.mark.slow
def test_a_run_without_metrics_is_scored_from_its_mllog_the_same(complete_run, tmp_path):
    whole = json.loads(score(complete_run, "--json", cwd=tmp_path).stdout)
    bare = copy_without(complete_run, "metrics.jsonl", tmp_path)
    result = score(bare, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    last_eval = [json.loads(line) for line in (complete_run / "metrics.jsonl").read_text().splitlines()
                 if '"kind": "eval"' in line][-1]
    assert got["images"] == last_eval["images"] > 0  # what the trainer counted: both epochs, at their batches
    for key in ("top1", "images", "throughput_img_s", "time_to_quality_s", "time_to_target_s", "total_flop",
                "valid_flops", "status", "mlperf_compliant", "mlperf_verdict"):
        assert got[key] == whole[key], key
    assert whole["mlperf_compliant"] is True
    assert any("metrics.jsonl is missing" in note for note in got["notes"])


@pytest.mark.slow
def test_a_run_without_metrics_whose_mllog_cannot_say_is_refused(max_steps_run, resumed_run_real, tmp_path):
    # stopped 3 steps into its first epoch: mllog.txt has no epoch_stop to count its images by
    error_line(score(copy_without(max_steps_run, "metrics.jsonl", tmp_path), cwd=tmp_path),
               "metrics.jsonl is missing", "epoch_stop for epoch 1")
    # resumed: the downtime between its segments is in metrics.jsonl only
    error_line(score(copy_without(resumed_run_real, "metrics.jsonl", tmp_path), "--no-check", cwd=tmp_path),
               "metrics.jsonl is missing", "resumed run (2 segments)")


@pytest.mark.slow
def test_a_run_without_mllog_is_scored_from_its_metrics_and_gets_no_verdict(complete_run, resumed_run_real, tmp_path):
    for run in (complete_run, resumed_run_real):  # the resumed one: in training time, its downtime left out
        bare = copy_without(run, "mllog.txt", tmp_path)
        result = score(bare, "--json", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        got = json.loads(result.stdout)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        last_eval = [m for m in records if m["kind"] == "eval"][-1]
        assert got["top1"] == last_eval["top1"] and got["images"] == last_eval["images"] > 0
        assert got["time_to_quality_s"] == pytest.approx(last_eval["seconds"], abs=0.01)
        assert got["throughput_img_s"] == pytest.approx(last_eval["images"] / last_eval["seconds"], rel=1e-3)
        config = yaml.safe_load((run / "config.yaml").read_text())
        arch, size, classes = config["arch"], config["image_size"], config["num_classes"]
        total = (last_eval["images"] * train_flops_per_image(arch, size, classes)
                 + sum(m["eval_images"] for m in records if m["kind"] == "eval") * eval_flops_per_image(arch, size, classes))
        assert got["total_flop"] == total
        assert got["valid_flops"] == pytest.approx(total / got["time_to_quality_s"] * (got["top1"] / 0.763) ** 5)
        assert got["mlperf_compliant"] is None and "mllog.txt is missing" in got["mlperf_verdict"]
        table = score(bare, cwd=tmp_path)
        assert table.returncode == 0 and table.stderr == ""
        assert [line for line in table.stdout.splitlines() if "mllog.txt" in line] == [
            f"{bare.name}: MLPerf: {got['mlperf_verdict']}"]  # what it cannot score, said once


@pytest.mark.slow
def test_a_resumed_run_that_completed_is_not_checkable_rather_than_failed(resumed_run_real, tmp_path):
    from helpers import compliance
    checked = compliance(resumed_run_real / "mllog.txt", cwd=tmp_path)  # the checker fails its repeated setup
    assert "FAILED" in checked.stdout + checked.stderr and "submission_org" in checked.stdout + checked.stderr
    for check in ([], ["--no-check"]):  # known without asking the checker
        got = json.loads(score(resumed_run_real, "--json", *check, cwd=tmp_path).stdout)
        assert got["status"] == "complete, resumed 1x"
        assert got["mlperf_compliant"] is None
        assert got["mlperf_verdict"] == "not checkable: resumed run (2 segments)"  # two starts of the trainer
        assert "one uninterrupted run" in got["mlperf_reason"]
    rows = score(resumed_run_real, cwd=tmp_path).stdout.splitlines()
    assert "FAILED" not in rows[1] and rows[1].split()[-2] == "-"  # the MLPerf column
    assert any(row.startswith("again: MLPerf: not checkable: resumed run (2 segments): the checker judges")
               for row in rows), rows


def test_runs_of_one_folder_name_are_told_apart_by_their_paths(tmp_path):
    from train.score import report_figure, score_run
    runs = []
    for parent in ("a", "b"):
        (tmp_path / parent).mkdir()
        runs.append(make_run(tmp_path / parent, "run", [(100, 0.5)], stop_s=100))
    other = make_run(tmp_path, "other", [(100, 0.5)], stop_s=100)
    result = score(*runs, other, "--no-check", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["a/run", "b/run", "other"]
    assert any(line.startswith("a/run: ") for line in lines) and any(line.startswith("b/run: ") for line in lines)
    figure = report_figure([score_run(run, 0.763, 5, 0.759, check=False) for run in (*runs, other)], 0.759)
    accuracy = figure.axes[1]
    assert [line.get_label() for line in accuracy.get_lines()][:3] == ["a/run", "b/run", "other"]
    alone = score(runs[0], "--no-check", cwd=tmp_path).stdout.splitlines()  # a lone run: its folder's name
    assert alone[1].split()[0] == "run"
