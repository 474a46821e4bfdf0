"""The planner's figure: images/s and time to train against GPU count, one line per all-reduce."""
from pathlib import Path


def draw_report(lines: dict[str, list[dict]], path, title: str) -> Path:
    """lines: all-reduce name -> its planned rows. Writes the PNG at `path`; returns it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (rate, time) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for number, (name, rows) in enumerate(lines.items()):
        gpus = [r["gpus"] for r in rows]
        style = {"color": f"C{number}", "marker": "o", "label": name}
        rate.plot(gpus, [r["img_per_s"] for r in rows], **style)
        time.plot(gpus, [r["time_to_train_s"] / 60 for r in rows], **style)
    all_gpus = sorted({r["gpus"] for rows in lines.values() for r in rows})
    if all_gpus:  # linear scaling from the smallest count of the first line, for scale
        first = next(rows for rows in lines.values() if rows)[0]
        rate.plot(all_gpus, [first["img_per_s"] * g / first["gpus"] for g in all_gpus], color="grey",
                  linestyle=":", label="linear")
    rate.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="training images / s", title=f"Throughput: {title}")
    time.set(xscale="log", yscale="log", xlabel="GPUs", ylabel="minutes", title="Time to train")
    for axis in (rate, time):
        axis.grid(alpha=0.3, which="both")
        axis.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
