"""The GPU check's figures (scripts/gpu_check.sh runs this on the GPU; on a CPU it runs small, for its
own test): one-GPU training images/s at the default per-GPU batch for each precision the GPU has
TensorCores for (bf16 from compute capability 8.0, fp16, fp32 as TF32), on synthetic data and through
DALI decoding generated JPEGs (so an input-bound step shows); the default precision compiled
(--compile, its first steps' compile time apart); peak memory per image; the ghost BatchNorm step
against plain BatchNorm (scripts/bench/ghost_bn.py); the planner's images/s for the GPU found beside
the measured; published anchors. Every training run is also a sync check: from its third step on, the
steps run under torch.cuda.set_sync_debug_mode("error"), so a step that waits for the GPU (a host
read, a blocking copy) ends the run with the place it did so, and the table says so.

Writes OUT/gpu_figures.json and prints a table. Runs the trainer in this process (`python -m train`'s
main), one run after another, each its own run directory.

    python scripts/gpu_figures.py --out DIR [--deadline-s S] [--arch resnet50 --image-size 224 --steps 60]
"""
import argparse
import contextlib
import gc
import io
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from train.device_choices import default_batch  # noqa: E402
from train.precision import BF16_CAPABILITY, resolve  # noqa: E402

# single-GPU anchors, published: name -> (images/s, what)
ANCHORS = {"A100-80GB, AMP, NVIDIA DeepLearningExamples PyTorch, batch 256": 2470,
           "H200, MLPerf Training v4.0 (8 GPUs, per GPU), MXNet, batch 400": 7950}
SYNC_FROM_STEP = 3  # steps before this one may wait (cuDNN's autotuning, the first step's host-memory reserve)
PLANNER_GPUS = ("h200", "h100", "a100", "v100")


@contextlib.contextmanager
def sync_checked(enabled: bool):
    """The training loop with torch.cuda.set_sync_debug_mode("error") from step SYNC_FROM_STEP on, off
    again at logging points, epoch ends, checkpoints and the end (where a run may read what it logs)."""
    from train.loop import Training
    if not enabled:
        yield
        return
    quiet = ("_log_window", "end_of_epoch", "evaluate", "save", "finish")
    originals = {name: getattr(Training, name) for name in ("train_step", *quiet)}

    def train_step(self, images, labels):
        if self.state.step >= SYNC_FROM_STEP:
            torch.cuda.set_sync_debug_mode("error")
        return originals["train_step"](self, images, labels)

    def quieted(name):
        def call(self, *args, **kwargs):
            torch.cuda.set_sync_debug_mode(0)
            return originals[name](self, *args, **kwargs)
        return call
    Training.train_step = train_step
    for name in quiet:
        setattr(Training, name, quieted(name))
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
        for name, function in originals.items():
            setattr(Training, name, function)


def train(run_dir: Path, argv: list[str], sync_check: bool) -> dict:
    """One run of the trainer in this process: its steady images/s (after the first logging window),
    the seconds of that first window beyond the steady rate (compiling, autotuning), its peak GPU
    memory, its per-GPU batch and header, or why it failed."""
    from train.__main__ import main
    out, err = io.StringIO(), io.StringIO()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    failure = ""
    try:
        with sync_checked(sync_check), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["--out-dir", str(run_dir), "--eval-every", "0", "--checkpoint-every", "1000", *argv])
    except RuntimeError as error:  # the sync check's own: the step waited for the GPU
        code, failure = 1, _where(error)
    finally:
        gc.unfreeze()  # (the loop freezes its long-lived objects; let them go before the next run)
        gc.collect()
    header = next((line for line in out.getvalue().splitlines() if line.startswith("training ")), "")
    if code != 0:
        return {"failed": failure or (err.getvalue().strip().splitlines() or [f"exit {code}"])[-1], "header": header}
    windows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    windows = [w for w in windows if w["kind"] == "train"]
    first, last = windows[0], windows[-1]
    rate = (last["images"] - first["images"]) / (last["seconds"] - first["seconds"])
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {"img_per_s": round(rate, 1), "first_window_extra_s": round(first["seconds"] - first["images"] / rate, 1),
            "batch": config["batch_size"], "peak_memory_gib": round(peak / 2 ** 30, 2),
            "peak_memory_mib_per_image": round(peak / 2 ** 20 / config["batch_size"], 1), "header": header}


def _where(error: Exception) -> str:
    """The sync check's error, with the innermost line of the trainer's code that led to it."""
    import traceback
    ours = tuple(str(REPO / package) for package in ("train", "models", "data"))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(ours)]
    place = f" at {Path(frames[-1].filename).relative_to(REPO)}:{frames[-1].lineno}" if frames else ""
    return f"synchronised{place}: {str(error).splitlines()[0]}"


def planner_img_s(gpu: str, batch: int, image_size: int) -> float | None:
    """The planner's images/s for one GPU of this kind at this batch (None: a GPU it does not know, or
    another image size than its 224 px)."""
    if gpu not in PLANNER_GPUS or image_size != 224:
        return None
    from train.plan.cli import parser, plans, setup_of
    args = parser().parse_args(["--gpu", gpu, "--gpus", "1", "--per-gpu-batch", str(batch)])
    return round(plans(setup_of(args), [1])[0][0]["img_per_s_per_gpu"], 1)


def ghost_bn_ratio(device: str, seconds: float) -> str:
    """scripts/bench/ghost_bn.py's headline on this device, or why there is none."""
    try:
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "bench" / "ghost_bn.py"), "--device", device],
                              capture_output=True, text=True, timeout=max(1, seconds), cwd=REPO)
    except subprocess.TimeoutExpired:
        return f"not measured: over {seconds:.0f} s"
    lines = done.stdout.strip().splitlines()
    return lines[-1] if done.returncode == 0 and lines else f"failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--deadline-s", type=float, default=420, help="stop starting runs after this many seconds")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=60, help="steps of each timed run")
    parser.add_argument("--jpegs", type=int, default=3072, help="generated JPEGs for the DALI runs")
    parser.add_argument("--batch-size", type=int, default=0, help="per-GPU batch (0: the trainer's default)")
    parser.add_argument("--skip", default="", help="comma-separated: compile, ghost-bn, dali")
    args = parser.parse_args()
    started, skip = time.time(), set(filter(None, args.skip.split(",")))
    args.out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    capability = tuple(torch.cuda.get_device_capability(device)) if cuda else None
    default = resolve("auto", device)
    precisions = [p for p in ("bf16", "fp16", "fp32") if cuda or p != "fp16"]
    if cuda and capability < BF16_CAPABILITY:
        precisions.remove("bf16")  # emulated there: nothing to measure
    figures = {"gpu": name, "capability": ".".join(map(str, capability)) if capability else None,
               "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2 ** 30, 1) if cuda else None,
               "default_precision": default, "sync_checked": cuda, "runs": [], "anchors": ANCHORS}
    common = ["--arch", args.arch, "--image-size", str(args.image_size), "--log-every", str(max(2, args.steps // 4))]

    def left() -> float:
        return args.deadline_s - (time.time() - started)

    def run(label: str, precision: str, loader: str, extra: list[str]) -> dict:
        row = {"run": label, "precision": precision, "loader": loader}
        if left() < 20:
            row["failed"] = "not run: the time budget is spent"
        else:
            batch = args.batch_size or default_batch(device, precision, args.image_size, args.arch)[0]
            row.update(train(args.out / f"run-{len(figures['runs'])}",
                             [*common, "--precision", precision, "--batch-size", str(batch), *extra], cuda))
        figures["runs"].append(row)
        print(json.dumps(row), flush=True)
        return row

    jpegs = args.out / "jpegs"
    if "dali" not in skip and not (jpegs / "train").is_dir():
        from loader import make_tree
        make_tree(jpegs, args.jpegs)
    for precision in precisions:
        run(f"synthetic {precision}", precision, "synthetic",
            ["--loader", "synthetic", "--synthetic-images", "10000000", "--max-steps", str(args.steps), "--workers", "0"])
    if "dali" not in skip:
        for precision in precisions:
            batch = args.batch_size or default_batch(device, precision, args.image_size, args.arch)[0]
            epochs = math.ceil(args.steps / max(1, args.jpegs // batch))
            run(f"dali {precision}", precision, "dali", ["--loader", "dali", "--data-dir", str(jpegs), "--epochs",
                                                         str(epochs), "--max-steps", str(args.steps)])
    if "compile" not in skip:
        row = run(f"synthetic {default} --compile", default, "synthetic",
                  ["--loader", "synthetic", "--synthetic-images", "10000000", "--max-steps", str(args.steps),
                   "--workers", "0", "--compile"])
        eager = next((r for r in figures["runs"] if r["run"] == f"synthetic {default}"), {})
        if "img_per_s" in row and "img_per_s" in eager:
            figures["compile"] = {"step_time_vs_eager": round(eager["img_per_s"] / row["img_per_s"], 3),
                                  "compile_s": row["first_window_extra_s"]}
    if "ghost-bn" not in skip:
        figures["ghost_bn"] = ghost_bn_ratio(device.type, min(150, left()))
    gpu = next((g for g in PLANNER_GPUS if g in name.lower()), None)
    eager = next((r for r in figures["runs"] if r["run"] == f"synthetic {default}" and "img_per_s" in r), None)
    if eager:
        figures["planner"] = {"gpu": gpu, "batch": eager["batch"], "measured_img_s": eager["img_per_s"],
                              "predicted_img_s": planner_img_s(gpu, eager["batch"], args.image_size) if gpu else None}
    (args.out / "gpu_figures.json").write_text(json.dumps(figures, indent=1))
    print("\n".join(table(figures)))
    sys.exit(1 if any("failed" in r for r in figures["runs"]) else 0)


def table(figures: dict) -> list[str]:
    lines = [f"{figures['gpu']} (compute capability {figures['capability']}, {figures['memory_gib']} GiB): "
             f"default precision {figures['default_precision']}",
             f"{'run':<34} {'batch':>5} {'img/s':>9} {'peak GiB':>9} {'MiB/img':>8}  sync check / loader"]
    checked = f"no sync from step {SYNC_FROM_STEP}" if figures["sync_checked"] else "sync not checked (no GPU)"
    for r in figures["runs"]:
        if "failed" in r:
            lines.append(f"{r['run']:<34} {'':>5} {'-':>9} {'':>9} {'':>8}  FAILED: {r['failed']}")
            continue
        loader = re.split(r" \| ", r["header"])[-2] if r["header"].count(" | ") >= 2 else "?"
        lines.append(f"{r['run']:<34} {r['batch']:>5} {r['img_per_s']:>9,.0f} {r['peak_memory_gib']:>9.2f} "
                     f"{r['peak_memory_mib_per_image']:>8.1f}  {checked} / {loader}")
    if "compile" in figures:
        c = figures["compile"]
        lines.append(f"--compile (default mode): step time {c['step_time_vs_eager']:.3f} x eager's, compile about "
                     f"{c['compile_s']:.0f} s")
    if "ghost_bn" in figures:
        lines.append(f"ghost BatchNorm step against plain: {figures['ghost_bn']}")
    plan = figures.get("planner")
    if plan:
        predicted = (f"{plan['predicted_img_s']:,.0f} img/s predicted" if plan["predicted_img_s"] else
                     "no prediction (a GPU or image size the planner has no figures for)")
        lines.append(f"planner ({plan['gpu'] or figures['gpu']}, batch {plan['batch']}): {predicted}, "
                     f"{plan['measured_img_s']:,.0f} img/s measured")
    lines += [f"published: {what}: {rate:,} img/s" for what, rate in figures["anchors"].items()]
    return lines


if __name__ == "__main__":
    main()
