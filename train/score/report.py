"""What the scorer shows: the text table of scores, and the report figure (throughput and accuracy
of each run)."""
from __future__ import annotations

import os
from pathlib import Path

from train.score.logs import read_metrics
from train.score.result import Score


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


def run_names(scores: list[Score]) -> list[str]:
    """Each run's name: the shortest ending of its path that no other run's path ends alike (runs a/run
    and b/run, not run twice); a lone run is its folder's name."""
    paths = [Path(os.path.abspath(s.run)).parts for s in scores]  # (abspath: "." and "x/.." get their names)
    names = []
    for number, parts in enumerate(paths):
        others = [other for n, other in enumerate(paths) if n != number]
        length = next((k for k in range(1, len(parts)) if all(other[-k:] != parts[-k:] for other in others)),
                      len(parts))  # all of it when no ending is its own (one run given twice)
        names.append(scores[number].run if length == len(parts) else "/".join(parts[-length:]))
    return names


# Each run's colour, marker and line style: where runs coincide, their markers of different shapes nest,
# each smaller than the one before (drawn on top), and their lines narrow and dash alike, so no run hides
# another (dotted lines mark resumes).
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", (0, (6, 2, 1, 2, 1, 2)))
MARKER_SIZES = (12, 7.5, 5, 3.5)  # each next one fits inside the one before, white-edged, with a ring to spare


def run_style(number: int) -> dict:
    """The matplotlib line properties of the number-th run, alike in both panels."""
    return dict(color=f"C{number % 10}", marker=MARKERS[number % len(MARKERS)],
                linestyle=LINESTYLES[number % len(LINESTYLES)], markersize=MARKER_SIZES[min(number, 3)],
                markeredgecolor="white", markeredgewidth=0.8, linewidth=max(0.9, 2.4 - 0.5 * number))


def eval_points(metrics: list[dict]) -> list[tuple[float, float]]:
    """(epoch, top-1) of each evaluation at the fractional epoch it was taken: the `epoch` of the train
    or epoch record of its step (an eval after 3 of 15 steps is at 0.2; the eval record's own `epoch`
    is the MLLOG epoch number, 1). An eval without such a record keeps its own `epoch`."""
    at_step = {m["step"]: m["epoch"] for m in metrics
               if m.get("kind") in ("train", "epoch") and "step" in m and "epoch" in m}
    return [(at_step.get(m.get("step"), m["epoch"]), m["top1"]) for m in metrics if m.get("kind") == "eval"]


def report_figure(scores: list[Score], target: float):
    """Two panels: training throughput over training seconds, top-1 over epochs; one style per run.
    An axis over which one run reaches more than 10x further than another is logarithmic."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    seconds_spans, epoch_spans = [], []
    for number, (s, name) in enumerate(zip(scores, run_names(scores))):
        metrics = read_metrics(Path(s.run), [])
        evals, style = eval_points(metrics), run_style(number)
        seconds_spans.append(_draw_throughput(left, metrics, name, style))
        right.plot([epoch for epoch, _ in evals], [top1 for _, top1 in evals], label=name, **style)
        epoch_spans.append(max((epoch for epoch, _ in evals), default=0))
    right.axhline(target, color="red", linestyle="--", linewidth=1, label=f"target {target}")
    left.set(xlabel="training seconds since run start (dotted: resumed)", ylabel="training images / s",
             title="Throughput")
    right.set(xlabel="epoch (fractional: when the evaluation was taken)", ylabel="top-1", title="Accuracy",
              ylim=(0, 1))
    for axis, spans in ((left, seconds_spans), (right, epoch_spans)):
        if not _log_when_uneven(axis, spans):
            axis.set_xlim(left=0)  # seconds and epochs since the run's start
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _log_when_uneven(axis, spans: list[float]) -> bool:
    """A log x axis, its ticks in plain numbers, when the runs' furthest points differ more than 10x:
    on a linear one the longest run squashes the others against the left edge."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    spans = [span for span in spans if span > 0]
    if len(spans) < 2 or max(spans) <= 10 * min(spans):
        return False
    axis.set_xscale("log")
    axis.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5), numticks=12))
    axis.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axis.xaxis.set_minor_formatter(NullFormatter())
    axis.set_xlabel(axis.get_xlabel() + ", log scale")
    return True


def _draw_throughput(axis, metrics: list[dict], name: str, style: dict) -> float:
    """One run's throughput line, broken at each resume (NaN after each segment: one line, one
    legend entry), and a dotted line at each resume; nothing drawn and no legend entry without points.
    Returns the furthest seconds drawn (0 without points)."""
    segments, resumes = throughput_series(metrics)
    xs, ys = [], []
    for segment in segments:
        xs += [seconds for seconds, _ in segment] + [float("nan")]
        ys += [rate for _, rate in segment] + [float("nan")]
    if segments:  # at most about a dozen markers on a long line
        axis.plot(xs, ys, label=name, markevery=max(1, len(xs) // 12), **style)
    for seconds in resumes:
        axis.axvline(seconds, color=style["color"], linestyle=":")
    return max((x for x in xs if x == x), default=0)


def draw_report(scores: list[Score], path: Path, target: float) -> Path:
    """The report figure saved as path, or as path/report.png for a folder; the file written."""
    import matplotlib.pyplot as plt
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        path = path / "report.png"
    fig = report_figure(scores, target)
    fig.savefig(path)
    plt.close(fig)
    return path


def table(scores: list[Score]) -> str:
    """One row per score, then each run's checker failure, level and notes."""
    rows = [("run", "status", "time s", "wall s", "to 75.9% s", "images", "img/s", "top-1", "total FLOP", "FLOPS",
             "Valid FLOPS", "MLPerf", "AI500 level")]
    names = run_names(scores)
    for s, name in zip(scores, names):
        rows.append((name, s.status, f"{s.time_to_quality_s:.1f}", f"{s.wall_time_s:.1f}",
                     "-" if s.time_to_target_s is None else f"{s.time_to_target_s:.1f}", f"{s.images:,}",
                     f"{s.throughput_img_s:.1f}", f"{s.top1:.4f}", f"{s.total_flop:.3e}", f"{s.flops:.3e}",
                     f"{s.valid_flops:.3e}", {True: "SUCCESS", False: "FAILED", None: "-"}[s.mlperf_compliant],
                     s.hpc_ai500_level or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    for s, name in zip(scores, names):
        if s.mlperf_compliant is False:
            lines.append(f"{name}: MLPerf checker: {s.mlperf_verdict}")
        elif s.mlperf_compliant is None and s.mlperf_reason not in ("", "--no-check"):  # why the column says -
            why = "" if s.mlperf_verdict.endswith(s.mlperf_reason) else f": {s.mlperf_reason}"
            lines.append(f"{name}: MLPerf: {s.mlperf_verdict}{why}")
        if s.level_reason:
            lines.append(f"{name}: HPC AI500 level {s.hpc_ai500_level}: {s.level_reason}")
        lines += [f"{name}: {note}" for note in s.notes]
    return "\n".join(lines)


def mlperf_line(aggregate: dict) -> str:
    """The MLPerf score of several runs (mlperf_score's answer) as the table's last line."""
    if not aggregate["valid"]:
        return f"MLPerf score: invalid: {aggregate['reason']}"
    return (f"MLPerf score: {aggregate['score_s']:.1f} s (olympic mean of {aggregate['averaged']} of "
            f"{aggregate['runs']} runs)")
