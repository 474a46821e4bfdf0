"""`python -m train.score RUN_DIR [RUN_DIR ...]`: time to quality, throughput, FLOPs, Valid FLOPS
(HPC AI500: FLOPS x (top1 / target) ** n, image classification target 0.763, n 5) and the MLPerf
verdict of training runs; `--time-s T --top1 A [--epochs 90]` scores a published result the same way.

FLOPs are counted, not assumed: training FLOPs per image of the run's arch and image size
(models.train_flops_per_image) x images trained, plus forward FLOPs x images evaluated.

A resumed run (metrics.jsonl has a `resume` record at the start of each later segment, with the
downtime `gap_s`) is measured in training time, the downtime excluded: time to quality, time to
target, throughput and FLOPS; `training_time_s` and `wall_time_s` (first run_start to the end) are
both given (the table's `time s` and `wall s`), and the status gains `, resumed Nx`
(`complete, resumed 1x`); the report breaks the throughput line at each resume and marks it with
a dotted line. The run's end is the last segment's run_stop; a last segment without one is
`crashed`. The MLPerf verdict stays the checker's (it fails a log with several run_start lines).
A run without `resume` records has training time = wall time, as before.
"""
import argparse
import json
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from models import eval_flops_per_image, train_flops_per_image

HPC_AI500_TARGET, HPC_AI500_POWER = 0.763, 5
MLPERF_TARGET = 0.759
IMAGENET_TRAIN_IMAGES = 1_281_167
# The hyperparameters of the reference recipe: changing any of them moves a run to the system level.
RECIPE_KEYS = ("optimizer", "global_batch_size", "epochs", "lr", "warmup_epochs", "end_lr", "lr_decay_power",
               "weight_decay", "momentum", "lars_eta", "lars_epsilon", "label_smoothing")


class ScoreError(Exception):
    """Nothing could be scored; the message says why."""


@dataclass
class Score:
    run: str
    time_to_quality_s: float
    images: int
    throughput_img_s: float
    top1: float
    total_flop: float
    flops: float
    valid_flops: float
    mlperf_compliant: bool | None = None
    mlperf_verdict: str = ""
    time_to_target_s: float | None = None
    reached_target: bool | None = None
    training_time_s: float | None = None
    wall_time_s: float | None = None
    status: str = "complete"
    hpc_ai500_level: str = ""
    level_reason: str = ""
    config_key: str = ""
    notes: list = field(default_factory=list)


def valid_flops(flops: float, top1: float, target: float = HPC_AI500_TARGET, power: float = HPC_AI500_POWER) -> float:
    return flops * (top1 / target) ** power


def read_mllog(path: Path, notes: list) -> list[dict]:
    events = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.startswith(":::MLLOG "):
            continue
        try:
            events.append(json.loads(line[len(":::MLLOG "):]))
        except json.JSONDecodeError:
            notes.append(f"line {number} of {path.name} is cut off; ignored")
    return events


def read_metrics(run_dir: Path, notes: list) -> list[dict]:
    """The records of run_dir/metrics.jsonl in file order; none when it is missing."""
    metrics = []
    if (run_dir / "metrics.jsonl").is_file():
        for line in (run_dir / "metrics.jsonl").read_text(errors="replace").splitlines():
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError:
                notes.append("a line of metrics.jsonl is cut off; ignored")
    return metrics


def training_seconds(time_ms: float, run_start_ms: float, resumes: list[dict]) -> float:
    """Seconds from the first run_start to time_ms, less the downtime of the resumes before it: the
    trainer's own `seconds` clock."""
    downtime = sum(r.get("gap_s") or 0 for r in resumes if r["time"] * 1000 <= time_ms)
    return (time_ms - run_start_ms) / 1000 - downtime


def compliance(mllog: Path) -> tuple[bool, str]:
    """The real mlperf_logging checker, ruleset 4.0.0, in the division the log declares."""
    result = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                             "--ruleset", "4.0.0", "--log_output", "/dev/null", str(mllog)],
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    if result.returncode == 0 and "SUCCESS" in output:
        return True, "SUCCESS"
    failures = [line for line in output.splitlines() if re.match(r"(WARNING|ERROR) ", line) and "FAILED" not in line]
    return False, (failures[0] if failures else output.strip().splitlines()[-1] if output.strip() else "FAILED")


def hpc_ai500_level(config: dict) -> tuple[str, str]:
    """Free, system or hardware level, from what the run changed against the reference recipe
    (ResNet-50 at 224 px, MLPerf LARS with a reference convergence point's hyperparameters)."""
    if config.get("arch") != "resnet50" or config.get("image_size") != 224:
        return "free", f"the model changed ({config.get('arch')} at {config.get('image_size')} px; reference resnet50 at 224)"
    preset = str(config.get("preset", ""))
    if preset.startswith("mlperf-bs"):
        from train.config import Config, load_yaml_overrides, resolve_preset
        # What the preset leaves out the run got from the trainer's defaults, so those are the reference too.
        reference = {**asdict(Config()), **load_yaml_overrides(str(resolve_preset(preset)), "preset")}
        # A key absent from the run's config.yaml (an older run) is unknown, not changed.
        changed = [k for k in RECIPE_KEYS if config.get(k) is not None and config[k] != reference[k]]
        if not changed:
            return "hardware", f"the reference recipe {preset} unchanged; only the hardware differs"
        return "system", f"{preset} with {', '.join(changed)} changed (system software and hyperparameters)"
    return "system", "no reference recipe preset: batch size and learning-rate policy are the system's own"


def score_run(run_dir: Path, target: float, power: float, mlperf_target: float, check: bool) -> Score:
    notes: list[str] = []
    mllog = run_dir / "mllog.txt"
    if not run_dir.exists():
        raise ScoreError(f"{run_dir} does not exist")
    if not mllog.is_file():
        raise ScoreError(f"{run_dir} holds no mllog.txt; is it a run directory?")
    events = read_mllog(mllog, notes)
    config = yaml.safe_load((run_dir / "config.yaml").read_text()) if (run_dir / "config.yaml").is_file() else {}
    starts = [e["time_ms"] for e in events if e["key"] == "run_start"]
    evals = [e for e in events if e["key"] == "eval_accuracy"]
    if not starts:
        raise ScoreError(f"{mllog} has no run_start; the run never began training")
    # One run_start per segment of a resumed run: only the last segment's run_stop ends the run.
    stops = [e for e in events if e["key"] == "run_stop" and e["time_ms"] >= starts[-1]]
    if not evals:
        raise ScoreError(f"{mllog} has no eval_accuracy; the run never evaluated, so it has no quality to score")
    run_start = starts[0]
    status = "complete"
    if stops:
        end_ms = stops[-1]["time_ms"]
        if stops[-1].get("metadata", {}).get("status") not in ("success",):
            status = "aborted"
    else:
        end_ms, status = evals[-1]["time_ms"], "crashed"
        notes.append("no run_stop: the run crashed or is still running; scored up to its last complete eval")
    metrics = read_metrics(run_dir, notes)
    resumes = [m for m in metrics if m.get("kind") == "resume"]
    wall_seconds, seconds = (end_ms - run_start) / 1000, training_seconds(end_ms, run_start, resumes)
    if seconds <= 0:
        raise ScoreError(f"{mllog}: run_stop is not after run_start; the log's clock is broken")
    if resumes:
        status += f", resumed {len(resumes)}x"
        notes.append(f"resumed {len(resumes)}x: time to quality, time to target and throughput are in training time "
                     f"({seconds:.1f} s); the wall time {wall_seconds:.1f} s includes {wall_seconds - seconds:.1f} s down")
    elif len(starts) > 1:
        notes.append(f"{len(starts)} run_start lines but no resume records in metrics.jsonl: the times include the "
                     "downtime between segments")
    last_eval_time = evals[-1]["time_ms"] if status == "crashed" else end_ms
    trained = [m for m in metrics if m.get("kind") in ("train", "epoch") and m["time"] * 1000 <= last_eval_time + 1]
    images = max((m["images"] for m in trained), default=0)
    eval_images = sum(m.get("eval_images", 0) for m in metrics if m.get("kind") == "eval")
    top1 = float(evals[-1]["value"])
    reached = [e for e in evals if e["value"] >= mlperf_target]
    arch, size = config.get("arch", "resnet50"), int(config.get("image_size", 224))
    classes = _classes(config)
    total_flop = images * train_flops_per_image(arch, size, classes) + eval_images * eval_flops_per_image(arch, size, classes)
    flops = total_flop / seconds
    level, reason = hpc_ai500_level(config)
    verdict = compliance(mllog) if check else (None, "not checked")
    key = json.dumps({k: config.get(k) for k in ("arch", "image_size", "global_batch_size", "optimizer", "lr",
                                                 "epochs", "warmup_epochs", "preset")}, sort_keys=True)
    return Score(run=str(run_dir), time_to_quality_s=round(seconds, 3), images=images,
                 throughput_img_s=round(images / seconds, 2), top1=top1, total_flop=total_flop, flops=flops,
                 valid_flops=valid_flops(flops, top1, target, power), mlperf_compliant=verdict[0],
                 mlperf_verdict=verdict[1], reached_target=bool(reached),
                 time_to_target_s=round(training_seconds(reached[0]["time_ms"], run_start, resumes), 3) if reached else None,
                 training_time_s=round(seconds, 3), wall_time_s=round(wall_seconds, 3), status=status,
                 hpc_ai500_level=level, level_reason=reason, config_key=key, notes=notes)


def _classes(config) -> int:
    """Classes of the run's model (only the last layer's FLOPs depend on it: 0.05% of ResNet-50's)."""
    if config.get("loader") == "synthetic":
        return int(config.get("synthetic_classes", 1000))
    return 1000 if config.get("data_dir") else 10  # ImageNet, or the embedded dataset's ten classes


def score_published(time_s: float, top1: float, epochs: float, train_images: int, arch: str, image_size: int,
                    target: float, power: float) -> Score:
    if time_s <= 0:
        raise ScoreError(f"--time-s must be positive, got {time_s}")
    if not 0 < top1 <= 1:
        raise ScoreError(f"--top1 is a fraction in (0, 1], got {top1}")
    images = round(epochs * train_images)
    total_flop = images * train_flops_per_image(arch, image_size)
    flops = total_flop / time_s
    return Score(run="published", time_to_quality_s=time_s, images=images, throughput_img_s=round(images / time_s, 2),
                 training_time_s=time_s, wall_time_s=time_s, top1=top1, total_flop=total_flop, flops=flops,
                 valid_flops=valid_flops(flops, top1, target, power),
                 status="published", notes=[f"{epochs:g} epochs x {train_images:,} images"])


def mlperf_score(scores: list[Score]) -> dict:
    """Olympic mean of time to target: drop the fastest and the slowest, mean of the rest. A run that
    never reached the target counts as the dropped slowest; two such runs make the set invalid."""
    if len({s.config_key for s in scores}) > 1:
        return {"valid": False, "reason": "the runs have different configurations; an MLPerf score needs one"}
    failed = [s for s in scores if not s.reached_target]
    if len(failed) >= 2:
        return {"valid": False, "reason": f"{len(failed)} runs never reached {MLPERF_TARGET}; at most one may fail"}
    times = sorted(s.time_to_target_s for s in scores if s.reached_target)
    kept = times[1:] if failed else times[1:-1]
    if not kept:
        return {"valid": False, "reason": "too few runs: need at least three"}
    return {"valid": True, "score_s": sum(kept) / len(kept), "runs": len(scores), "averaged": len(kept)}


def throughput_series(metrics: list[dict]) -> tuple[list[list[tuple[float, float]]], list[float]]:
    """What the throughput panel draws of one run: (seconds, img/s) points, one list per segment (a
    resume starts a new one), and the `seconds` of each resume. The points are the `train` records;
    a run shorter than two logging windows has the `epoch` records' throughput too."""
    train = [m for m in metrics if m.get("kind") == "train"]
    kinds = ("train",) if len(train) >= 2 else ("train", "epoch")
    segments, resumes = [[]], []
    for m in metrics:  # in file order: seconds grows, and a resume comes before its segment's records
        if m.get("kind") == "resume":
            resumes.append(m["seconds"])
            segments.append([])
        elif m.get("kind") in kinds and "img_per_s" in m:
            segments[-1].append((m["seconds"], m["img_per_s"]))
    return [segment for segment in segments if segment], resumes


def report_figure(scores: list[Score], target: float):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for number, s in enumerate(scores):
        metrics = read_metrics(Path(s.run), [])
        evals = [m for m in metrics if m.get("kind") == "eval"]
        name, colour = Path(s.run).name, f"C{number}"  # one colour per run in both panels
        segments, resumes = throughput_series(metrics)
        if segments:  # nothing drawn, no legend entry
            xs, ys = [], []
            for segment in segments:  # NaN after each: one line, one legend entry, broken at each resume
                xs += [seconds for seconds, _ in segment] + [float("nan")]
                ys += [rate for _, rate in segment] + [float("nan")]
            left.plot(xs, ys, color=colour, marker="o" if len(xs) < 20 else None, label=name)
        for seconds in resumes:
            left.axvline(seconds, color=colour, linestyle=":")
        right.plot([m["epoch"] for m in evals], [m["top1"] for m in evals], color=colour, marker="o", label=name)
    right.axhline(target, color="red", linestyle="--", label=f"target {target}")
    left.set(xlabel="training seconds since run start (dotted: resumed)", ylabel="training images / s",
             title="Throughput")
    right.set(xlabel="epoch", ylabel="top-1", title="Accuracy", ylim=(0, 1))
    for axis in (left, right):
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    fig.tight_layout()
    return fig


def draw_report(scores: list[Score], path: Path, target: float) -> Path:
    import matplotlib.pyplot as plt
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        path = path / "report.png"
    fig = report_figure(scores, target)
    fig.savefig(path)
    plt.close(fig)
    return path


def _table(scores: list[Score]) -> str:
    rows = [("run", "status", "time s", "wall s", "to 75.9% s", "images", "img/s", "top-1", "total FLOP", "FLOPS",
             "Valid FLOPS", "MLPerf", "AI500 level")]
    for s in scores:
        rows.append((Path(s.run).name, s.status, f"{s.time_to_quality_s:.1f}", f"{s.wall_time_s:.1f}",
                     "-" if s.time_to_target_s is None else f"{s.time_to_target_s:.1f}", f"{s.images:,}",
                     f"{s.throughput_img_s:.1f}", f"{s.top1:.4f}", f"{s.total_flop:.3e}", f"{s.flops:.3e}",
                     f"{s.valid_flops:.3e}", {True: "SUCCESS", False: "FAILED", None: "-"}[s.mlperf_compliant],
                     s.hpc_ai500_level or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) for r in rows]
    for s in scores:
        if s.mlperf_compliant is False:
            lines.append(f"{Path(s.run).name}: MLPerf checker: {s.mlperf_verdict}")
        if s.level_reason:
            lines.append(f"{Path(s.run).name}: HPC AI500 level {s.hpc_ai500_level}: {s.level_reason}")
        lines += [f"{Path(s.run).name}: {note}" for note in s.notes]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.score", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="*", help="run directories")
    parser.add_argument("--json", action="store_true", help="one JSON object (a list plus the aggregate for several runs)")
    parser.add_argument("--target", type=float, default=HPC_AI500_TARGET, help="Valid FLOPS target top-1 (HPC AI500: 0.763)")
    parser.add_argument("--power", type=float, default=HPC_AI500_POWER, help="Valid FLOPS exponent n (HPC AI500: 5)")
    parser.add_argument("--mlperf-target", type=float, default=MLPERF_TARGET)
    parser.add_argument("--no-check", action="store_true", help="skip the MLPerf compliance checker")
    parser.add_argument("--report", help="PNG file (or folder) for throughput and accuracy plots")
    published = parser.add_argument_group("a published result")
    published.add_argument("--time-s", type=float)
    published.add_argument("--top1", type=float)
    published.add_argument("--epochs", type=float, default=90)
    published.add_argument("--train-images", type=int, default=IMAGENET_TRAIN_IMAGES)
    published.add_argument("--arch", default="resnet50")
    published.add_argument("--image-size", type=int, default=224)
    args = parser.parse_args(argv)
    try:
        if args.time_s is not None or args.top1 is not None:
            if args.time_s is None or args.top1 is None:
                raise ScoreError("a published result needs both --time-s and --top1")
            scores = [score_published(args.time_s, args.top1, args.epochs, args.train_images, args.arch,
                                      args.image_size, args.target, args.power)]
        elif args.runs:
            scores, problems = [], []
            for run in args.runs:
                try:
                    scores.append(score_run(Path(run), args.target, args.power, args.mlperf_target, not args.no_check))
                except ScoreError as err:
                    problems.append(str(err))
            if not scores:  # each problem once, in the one error line
                raise ScoreError("; ".join(problems))
            for problem in problems:
                print(f"warning: {problem}", file=sys.stderr)
        else:
            raise ScoreError("give run directories, or --time-s and --top1 for a published result")
    except ScoreError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    aggregate = mlperf_score(scores) if len(scores) > 1 else None
    if args.report:
        print(f"report: {draw_report([s for s in scores if s.status != 'published'], Path(args.report), args.mlperf_target)}",
              file=sys.stderr)
    if args.json:
        if len(scores) == 1:
            print(json.dumps(asdict(scores[0])))
        else:
            print(json.dumps({"runs": [asdict(s) for s in scores], "mlperf": aggregate}))
    else:
        print(_table(scores))
        if aggregate:
            print("MLPerf score: " + (f"{aggregate['score_s']:.1f} s (olympic mean of {aggregate['averaged']} of "
                                       f"{aggregate['runs']} runs)" if aggregate["valid"] else f"invalid: {aggregate['reason']}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
