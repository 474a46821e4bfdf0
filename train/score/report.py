"""What the scorer shows: the text table of scores, and the report figure (throughput and accuracy
of each run)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from train.score.logs import read_metrics

if TYPE_CHECKING:
    from train.score.runs import Score


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
    """Two panels: training throughput over training seconds, top-1 over epochs; one colour per run."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for number, s in enumerate(scores):
        metrics = read_metrics(Path(s.run), [])
        evals = [m for m in metrics if m.get("kind") == "eval"]
        name, colour = Path(s.run).name, f"C{number}"  # one colour per run in both panels
        _draw_throughput(left, metrics, name, colour)
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


def _draw_throughput(axis, metrics: list[dict], name: str, colour: str) -> None:
    """One run's throughput line, broken at each resume (NaN after each segment: one line, one
    legend entry), and a dotted line at each resume; nothing drawn and no legend entry without points."""
    segments, resumes = throughput_series(metrics)
    if segments:
        xs, ys = [], []
        for segment in segments:
            xs += [seconds for seconds, _ in segment] + [float("nan")]
            ys += [rate for _, rate in segment] + [float("nan")]
        axis.plot(xs, ys, color=colour, marker="o" if len(xs) < 20 else None, label=name)
    for seconds in resumes:
        axis.axvline(seconds, color=colour, linestyle=":")


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


def mlperf_line(aggregate: dict) -> str:
    """The MLPerf score of several runs (mlperf_score's answer) as the table's last line."""
    if not aggregate["valid"]:
        return f"MLPerf score: invalid: {aggregate['reason']}"
    return (f"MLPerf score: {aggregate['score_s']:.1f} s (olympic mean of {aggregate['averaged']} of "
            f"{aggregate['runs']} runs)")
