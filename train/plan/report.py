"""The planner's figure: images/s and time to train against GPU count, one line per all-reduce.

Lines that coincide would hide each other, so each algorithm has its own line style, marker and
width (the first drawn widest), and the legend says which lines lie within 1% of an earlier one.
The axes are labelled in plain numbers: the GPU counts themselves, and 1-2-5 steps on log scales.
"""
import os
from pathlib import Path

from train.errors import UsageError

FORMATS = (".png", ".svg", ".pdf")
SAME_WITHIN = 0.01  # lines closer than this at every count are named as one in the legend
STYLES = {  # widest first, so that a line drawn over another leaves it showing
    "flat": {"linestyle": "-", "marker": "o", "markersize": 11, "markerfacecolor": "none", "linewidth": 4.0},
    "hierarchical": {"linestyle": "--", "marker": "s", "markersize": 8, "markerfacecolor": "none", "linewidth": 2.5},
    "torus": {"linestyle": "-.", "marker": "^", "markersize": 6, "linewidth": 1.8},
    "tree": {"linestyle": ":", "marker": "x", "markersize": 7, "linewidth": 1.5},
}


def checked_path(text: str) -> Path:
    """The file --report will write, refused before any work: a .png, .svg or .pdf (a name without a
    suffix gets .png), not a folder."""
    path = Path(text)
    if path.is_dir():
        raise UsageError(f"--report {text} is a folder; give a file in it, e.g. {path / 'plan.png'}")
    if not path.suffix:
        return path.with_name(path.name + ".png")
    if path.suffix.lower() not in FORMATS:
        raise UsageError(f"--report {text}: unknown extension {path.suffix!r}; use one of {', '.join(FORMATS)}")
    return path


def same_as(lines: dict[str, list[dict]], name: str) -> str | None:
    """The first line drawn before `name` that it matches within SAME_WITHIN at every count."""
    def series(rows):
        return [(r["gpus"], r["img_per_s"], r["time_to_train_s"]) for r in rows]
    mine = series(lines[name])
    for other in list(lines)[:list(lines).index(name)]:
        theirs = series(lines[other])
        if mine and [g for g, _, _ in mine] == [g for g, _, _ in theirs] and all(
                abs(a - b) <= SAME_WITHIN * b for (_, *ours), (_, *its) in zip(mine, theirs)
                for a, b in zip(ours, its)):
            return other
    return None


# (y label, value of a row, log scale): whole-job throughput, throughput per GPU (where the
# algorithms part), time to train
PANELS = (("training images / s", lambda r: r["img_per_s"], True),
          ("training images / s per GPU", lambda r: r["img_per_s_per_gpu"], False),
          ("minutes to train", lambda r: r["time_to_train_s"] / 60, True))


def plain_axes(axis, gpus: list[int], log_y: bool) -> None:
    """A log GPU axis with one tick per planned count, and a y axis in plain numbers (1-2-5 steps
    when logarithmic), never 10^k."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator
    axis.set_xscale("log")
    axis.xaxis.set_major_locator(FixedLocator(gpus))
    axis.xaxis.set_minor_locator(NullLocator())
    axis.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    axis.tick_params(axis="x", labelrotation=45 if len(gpus) > 6 else 0)
    if log_y:
        axis.set_yscale("log")
        axis.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        axis.yaxis.set_minor_formatter(NullFormatter())
    axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 else f"{v:g}"))
    if not log_y:
        axis.set_ylim(bottom=0)  # a linear axis from zero: gaps between lines at their true size


def figure(lines: dict[str, list[dict]], title: str):
    """lines: all-reduce name -> its planned rows. Returns the matplotlib Figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(PANELS), figsize=(16, 5), dpi=100)
    all_gpus = sorted({r["gpus"] for rows in lines.values() for r in rows})
    for number, (name, rows) in enumerate(lines.items()):
        twin = same_as(lines, name)
        style = {"color": f"C{number}", "label": name + (f" (same as {twin} within 1%)" if twin else ""),
                 "zorder": 2 + number, **STYLES.get(name, {"marker": "o"})}
        for axis, (_, value, _) in zip(axes, PANELS):
            axis.plot([r["gpus"] for r in rows], [value(r) for r in rows], **style)
    first = next((rows[0] for rows in lines.values() if rows), None)
    if first:  # linear scaling from the smallest count of the first line, for scale
        for axis, per_gpu in ((axes[0], first["img_per_s"] / first["gpus"]), (axes[1], first["img_per_s_per_gpu"])):
            scale = [per_gpu * g for g in all_gpus] if axis is axes[0] else [per_gpu] * len(all_gpus)
            axis.plot(all_gpus, scale, color="black", linestyle=(0, (1, 2)), linewidth=1,
                      label=f"linear scaling from {first['gpus']:,} GPUs", zorder=10)
    for axis, (ylabel, _, log_y) in zip(axes, PANELS):
        axis.set(xlabel="GPUs", ylabel=ylabel)
        plain_axes(axis, all_gpus, log_y)
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
    fig.suptitle(f"Planned run: {title} (one line per all-reduce)")
    fig.tight_layout()
    return fig


def draw_report(lines: dict[str, list[dict]], path: Path, title: str) -> str:
    """Writes the figure at `path` (from checked_path), whole or not at all; returns what to print:
    the path, and the folder if it had to be made. An unwritable path is a UsageError."""
    import matplotlib.pyplot as plt
    fig = figure(lines, title)
    made = not path.parent.exists()
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(partial, format=path.suffix[1:].lower())
        os.replace(partial, path)
    except OSError as err:
        if partial.parent.is_dir():
            partial.unlink(missing_ok=True)
        raise UsageError(f"cannot write --report {path}: {err.strerror or err}; choose a writable path") from None
    finally:
        plt.close(fig)
    return f"{path}" + (f" (made the folder {path.parent})" if made else "")
