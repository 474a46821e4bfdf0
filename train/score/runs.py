"""Scoring one run directory, or a published (time, accuracy, epochs) triple, into a Score."""
import json
from dataclasses import dataclass, field
from pathlib import Path

from train.rundir import RunDir
from train.runlock import describe, running
from train.score.flops import HPC_AI500_POWER, HPC_AI500_TARGET, IMAGENET_TRAIN_IMAGES, published_flop, run_flop, valid_flops
from train.score.level import hpc_ai500_level
from train.score.logs import read_config, read_metrics, read_mllog, training_seconds
from train.score.mlperf import compliance
from train.score.result import Score, ScoreError
from train.schedule import EpochClock, batch_changes

# The settings that make runs one configuration for an MLPerf score.
CONFIG_KEYS = ("arch", "image_size", "global_batch_size", "optimizer", "lr", "epochs", "warmup_epochs", "preset",
               "lr_schedule", "batch_schedule", "bn_group_size", "bn_recompute_batches", "augment_off_epoch")


@dataclass
class _Log:
    """What mllog.txt says of a run: the run_start of each segment (ms), its evals, its end and status
    (crashed: the last segment has no run_stop), its training images per epoch (train_samples), how
    many times the trainer began writing it (segments) and all its events."""
    starts: list[float]
    evals: list[dict]
    end_ms: float
    status: str
    train_images: int | None = None
    segments: int = 1
    events: list = field(default_factory=list)


def _read_log(mllog: Path, notes: list) -> _Log:
    events = read_mllog(mllog, notes)
    starts = [e["time_ms"] for e in events if e["key"] == "run_start"]
    evals = [e for e in events if e["key"] == "eval_accuracy"]
    if not starts:
        raise ScoreError(f"{mllog} has no run_start; the run never began training")
    # Each start of the trainer appends its setup to the log, from init_start on (train/runlog.py), even
    # one that fails before run_start; a hand-made log may have run_start alone.
    segments = max(sum(e["key"] == "init_start" for e in events), len(starts))
    # One run_start per segment of a resumed run: only the last segment's run_stop ends the run.
    stops = [e for e in events if e["key"] == "run_stop" and e["time_ms"] >= starts[-1]]
    if not evals:
        raise ScoreError(f"{mllog} has no eval_accuracy; the run never evaluated, so it has no quality to score")
    train_images = next((e["value"] for e in events if e["key"] == "train_samples"), None)
    if not stops:
        return _Log(starts, evals, evals[-1]["time_ms"], "crashed", train_images, segments, events)
    status = "complete" if stops[-1].get("metadata", {}).get("status") == "success" else "aborted"
    return _Log(starts, evals, stops[-1]["time_ms"], status, train_images, segments, events)


def _records_from_mllog(mllog: Path, log: _Log) -> list[dict]:
    """Stand-ins for the metrics.jsonl records the score reads, counted from mllog.txt when metrics.jsonl
    is missing: an `epoch` record (step, epoch, images) at each epoch_stop and an `eval` record
    (eval_samples images, with no size or flips: config.yaml's count) at each eval, up to the run's end;
    ScoreError naming what cannot be counted."""
    missing = f"{RunDir(mllog.parent).metrics} is missing"
    if log.segments > 1:
        raise ScoreError(f"{missing} and {mllog} holds a resumed run ({log.segments} segments): its training time "
                         "needs the downtime between segments, which only metrics.jsonl's resume records hold")
    events = [e for e in log.events if e["time_ms"] <= log.end_ms]
    first = {}  # the first value of each setup key
    for e in events:
        first.setdefault(e["key"], e["value"])
    for key in ("train_samples", "global_batch_size", "eval_samples"):
        if not isinstance(first.get(key), int):
            raise ScoreError(f"{missing} and {mllog} has no {key}: the images trained and evaluated cannot be counted")
    stopped = {_epoch_num(e): e["time_ms"] for e in events if e["key"] == "epoch_stop"}
    unfinished = sorted({_epoch_num(e) for e in events if e["key"] == "epoch_start"} - set(stopped))
    if unfinished:  # stopped mid-epoch (--max-steps): the steps taken in it are in metrics.jsonl only
        raise ScoreError(f"{missing} and {mllog} has no epoch_stop for epoch {unfinished[0]} before the run's end: "
                         "the images trained in it cannot be counted")
    # A global_batch_size with an epoch_num is a --batch-schedule change from that epoch (1-based) on.
    changes = [(e["metadata"]["epoch_num"] - 1, e["value"]) for e in events
               if e["key"] == "global_batch_size" and "epoch_num" in e.get("metadata", {})]
    try:
        clock = EpochClock(first["train_samples"], first["global_batch_size"], changes)
    except ValueError as err:
        raise ScoreError(f"{missing} and {mllog} cannot be counted from: {err}") from None
    records, step, images = [], 0, 0
    for epoch in range(1, max(stopped, default=0) + 1):  # epochs run from 1, each after the one before
        step += clock.steps_in(epoch - 1)
        images += clock.steps_in(epoch - 1) * clock.global_batch(epoch - 1)
        records.append({"kind": "epoch", "step": step, "epoch": epoch, "images": images,
                        "time": stopped.get(epoch, 0) / 1000})
    records += [{"kind": "eval", "eval_images": first["eval_samples"], "time": e["time_ms"] / 1000}
                for e in log.evals if e["time_ms"] <= log.end_ms]
    return records


def _epoch_num(event: dict):
    return (event.get("metadata") or {}).get("epoch_num")


def _log_from_metrics(run_dir: Path, metrics: list[dict]) -> _Log:
    """What metrics.jsonl says in place of a missing mllog.txt: its run_start (the wall-clock time of its
    first record less the training seconds it gives) and its evals; the run ends at its last eval, as
    nothing there says how or when it stopped (status "unknown")."""
    evals = [{"time_ms": m["time"] * 1000, "value": m["top1"]} for m in metrics if m.get("kind") == "eval"]
    if not evals:
        raise ScoreError(f"{run_dir} holds no mllog.txt and its metrics.jsonl has no eval record; the run never "
                         "evaluated, so it has no quality to score")
    first = next(m for m in metrics if "seconds" in m and "time" in m)  # (an eval record has both)
    return _Log([(first["time"] - first["seconds"]) * 1000], evals, evals[-1]["time_ms"], "unknown")


def _how_it_ended(run_dir: Path, config: dict, metrics: list[dict], log: _Log, notes: list) -> tuple[str, str]:
    """The run's status, and why it gets no MLPerf verdict ("" when the checker judges it). Only a run
    that ended by itself (its epochs trained, its target reached, or stopped by the trainer: complete
    or aborted) is a result; one cut short gets no verdict, whatever the checker would say of its log."""
    if log.status == "unknown":
        return "unknown", ("no verdict: mllog.txt is missing, and the MLPerf verdict needs it; timed by metrics.jsonl "
                           "to its last eval")
    if log.status == "crashed":
        step = RunDir(run_dir).preempted_at()  # (the marker beside checkpoint.pt of a run stopped by a signal; a resume removes it)
        if step is not None:
            notes.append(f"preempted at step {step}: resumable, its checkpoint.pt continues it (start the same "
                         f"command with --out-dir {run_dir}); scored up to its last complete eval")
            return "preempted", f"no verdict: preempted at step {step}, the run has not ended"
        holder = running(run_dir)
        if holder:  # its job holds the run directory's lock (train/runlock.py)
            notes.append(f"running ({describe(holder)}); scored up to its last complete eval")
            return "running", "no verdict: the run has not ended"
        notes.append("no run_stop and no job holds its lock: the run crashed; scored up to its last complete eval")
        return "crashed", "no verdict: the run ended without run_stop (crashed)"
    cut_short = _max_steps_stop(config, metrics, log)
    if cut_short:
        return "stopped at max-steps", (f"no verdict: stopped at max-steps, {cut_short}; a result trains its epochs "
                                        "or reaches its target")
    return log.status, ""


def _mlperf_verdict(mllog: Path, log: _Log, no_verdict: str, check: bool) -> tuple[bool | None, str, str]:
    """(compliant, verdict, why there is none): the checker's, or None and why it is not asked."""
    if no_verdict:
        return None, no_verdict, no_verdict.removeprefix("no verdict: ")
    if log.segments > 1:  # the checker would fail it on the repeated setup keys, whatever the run was
        return None, f"not checkable: resumed run ({log.segments} segments)", (
            "the checker judges the log of one uninterrupted run; each segment of a resumed run logs the run's "
            "setup again (submission_org and the other setup keys), which it fails")
    if not check:
        return None, "not checked", "--no-check"
    return (*compliance(mllog), "")


def _max_steps_stop(config: dict, metrics: list[dict], log: _Log) -> str:
    """How far a run stopped by --max-steps got ("3 of 240 steps, epoch 0.2 of 16"), or "" when it was
    not stopped so: it trained its epochs or reached its --target-accuracy."""
    max_steps, epochs = config.get("max_steps") or 0, config.get("epochs") or 0
    trained = [m for m in metrics if m.get("kind") in ("train", "epoch")]
    step = max((m.get("step", 0) for m in trained), default=0)
    epoch = max((m.get("epoch", 0) for m in trained), default=0)
    target = config.get("target_accuracy") or 0
    if not (max_steps and step >= max_steps and epoch < epochs) or (target and log.evals[-1]["value"] >= target):
        return ""
    try:  # the steps of its epochs, as the trainer counts them
        clock = EpochClock(int(log.train_images), int(config["global_batch_size"]),
                           batch_changes(config.get("batch_schedule") or ""), int(epochs))
        of_steps = f"{step} of {clock.total_steps} steps"
    except (KeyError, TypeError, ValueError):  # an older or hand-made run: its epochs say enough
        of_steps = f"step {step}"
    return f"{of_steps}, epoch {round(epoch, 2):g} of {epochs:g}"


def _note_segments(status: str, log: _Log, resumes: list[dict], seconds: float, wall_seconds: float,
                   notes: list) -> str:
    """The run's status with its resumes (`complete, resumed 1x`); notes how its times were taken."""
    if resumes:
        notes.append(f"resumed {len(resumes)}x: time to quality, time to target and throughput are in training time "
                     f"({seconds:.1f} s); the wall time {wall_seconds:.1f} s includes {wall_seconds - seconds:.1f} s down")
        return f"{status}, resumed {len(resumes)}x"
    if len(log.starts) > 1:
        notes.append(f"{len(log.starts)} run_start lines but no resume records in metrics.jsonl: the times include the "
                     "downtime between segments")
    return status


def score_run(run_dir: Path, target: float, power: float, mlperf_target: float, check: bool) -> Score:
    """Score one run directory up to its end (its last eval if it crashed); ScoreError if it cannot be."""
    mllog = RunDir(run_dir).mllog
    if not run_dir.exists():
        raise ScoreError(f"{run_dir} does not exist")
    notes: list[str] = []
    config = read_config(run_dir)
    metrics = read_metrics(run_dir, notes)
    if not mllog.is_file():
        if not metrics:
            raise ScoreError(f"{run_dir} holds no mllog.txt or metrics.jsonl; is it a run directory?")
        log = _log_from_metrics(run_dir, metrics)
    else:
        log = _read_log(mllog, notes)
    if not metrics:  # the images and evaluations are counted from mllog.txt instead, or not at all
        metrics = _records_from_mllog(mllog, log)
        notes.append("metrics.jsonl is missing: images trained and evaluated counted from mllog.txt (train_samples, "
                     "global_batch_size, epoch_stop, eval_samples)")
    resumes = [m for m in metrics if m.get("kind") == "resume"]
    run_start = log.starts[0]
    wall_seconds, seconds = (log.end_ms - run_start) / 1000, training_seconds(log.end_ms, run_start, resumes)
    if seconds <= 0:
        raise ScoreError(f"{mllog}: run_stop is not after run_start; the log's clock is broken")
    status, no_verdict = _how_it_ended(run_dir, config, metrics, log, notes)
    status = _note_segments(status, log, resumes, seconds, wall_seconds, notes)
    # The images trained up to the end (a crashed run's end is its last eval), and all evaluations.
    trained = [m for m in metrics if m.get("kind") in ("train", "epoch") and m["time"] * 1000 <= log.end_ms + 1]
    images = max((m["images"] for m in trained), default=0)
    top1 = float(log.evals[-1]["value"])
    reached = [e for e in log.evals if e["value"] >= mlperf_target]
    # each evaluation at the size and flips its record holds; the spans of crop sizes from the epoch
    # records, less those a resume from an earlier checkpoint trained again
    evaluations = [m for m in metrics if m.get("kind") == "eval"]
    spans = [m for m in metrics if m.get("kind") in ("epoch", "resume") and m["time"] * 1000 <= log.end_ms + 1]
    total_flop = run_flop(config, images, evaluations, spans)
    flops = total_flop / seconds
    level, reason = hpc_ai500_level(config)
    verdict = _mlperf_verdict(mllog, log, no_verdict, check)
    return Score(run=str(run_dir), time_to_quality_s=round(seconds, 3), images=images,
                 throughput_img_s=round(images / seconds, 2), top1=top1, total_flop=total_flop, flops=flops,
                 valid_flops=valid_flops(flops, top1, target, power), mlperf_compliant=verdict[0],
                 mlperf_verdict=verdict[1], mlperf_reason=verdict[2], reached_target=bool(reached),
                 time_to_target_s=round(training_seconds(reached[0]["time_ms"], run_start, resumes), 3) if reached else None,
                 training_time_s=round(seconds, 3), wall_time_s=round(wall_seconds, 3), status=status,
                 hpc_ai500_level=level, level_reason=reason,
                 config_key=json.dumps({k: config.get(k) for k in CONFIG_KEYS}, sort_keys=True), notes=notes)


def score_published(time_s: float, top1: float, epochs: float = 90, *, train_images: int = IMAGENET_TRAIN_IMAGES,
                    arch: str = "resnet50", image_size: int = 224, target: float = HPC_AI500_TARGET,
                    power: float = HPC_AI500_POWER) -> Score:
    """Score a published result: epochs x train_images images trained in time_s seconds to top1."""
    if time_s <= 0:
        raise ScoreError(f"--time-s must be positive, got {time_s}")
    if not 0 < top1 <= 1:
        raise ScoreError(f"--top1 is a fraction in (0, 1], got {top1}")
    images = round(epochs * train_images)
    total_flop = published_flop(images, arch, image_size)
    flops = total_flop / time_s
    return Score(run="published", time_to_quality_s=time_s, images=images, throughput_img_s=round(images / time_s, 2),
                 training_time_s=time_s, wall_time_s=time_s, top1=top1, total_flop=total_flop, flops=flops,
                 valid_flops=valid_flops(flops, top1, target, power),
                 status="published", notes=[f"{epochs:g} epochs x {train_images:,} images"])
