"""`python -m train.bench train|infer ...`: how fast the trainer's own step runs, and how fast the
trained model answers (docs/bench.md).

train [any flag of python -m train]: the run's own loop (train/loop.py) for --warmup-steps then
--steps measured steps, on --loader synthetic by default (the user's data with --data-dir, the
embedded dataset for another loader without one), with no evaluation and no checkpoint. A StepTimer
hook (train/bench_hooks.py) times each step's wait for its batch and its compute; it synchronises the
device around them, which only the bench does (a run never waits for the device in its steps). Per-rank
figures are gathered at the last measured step; rank 0 prints the table and writes the report. With
--profile DIR a ProfileTrace hook writes a torch.profiler trace of a few measured steps per rank.

infer [CHECKPOINT_OR_RUN]: latency percentiles and images/s per batch size for each backend (eager,
compile: torch.compile, onnxruntime), in the run's precision (an untrained --arch without a source),
the device synchronised around each timed call; a table, the JSON report and a PNG beside it.
"""
from __future__ import annotations

import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from train.bench_flags import BACKENDS, mode_parser, parser
from train.errors import UsageError

if TYPE_CHECKING:
    import torch

# torch and numpy are imported by the code that measures: --help and a refused flag answer without them

TRAIN_KEYS = ("images_per_s", "images_per_s_per_rank", "data_wait_ms_p50", "data_wait_ms_p95", "compute_ms_p50",
              "compute_ms_p95", "compute_alone_ms_p50", "input_cost_ms_p50", "input_bound", "steps", "ranks",
              "image_size", "image_sizes")
INPUT_BOUND_SHARE = 0.10  # input bound: the input costs the median step more than this share of it
PERCENTILES = (50, 90, 95, 99)


# train ---------------------------------------------------------------------------------------------
def train_report(ranks: list) -> dict:
    """The report from every rank's (measured steps, quiet computes): per step the slowest rank's wait
    and compute (a step is as slow as its slowest rank), their percentiles, images/s over the steps'
    time; the slowest rank's median quiet compute (the step alone), and what the input costs the median
    step beyond it (its wait, and the cores its threads took from the compute)."""
    import numpy as np
    measured = [steps for steps, _ in ranks]
    waits = np.array([[wait for wait, _, _ in steps] for steps in measured]).max(axis=0)
    computes = np.array([[compute for _, compute, _ in steps] for steps in measured]).max(axis=0)
    images = sum(n for steps in measured for _, _, n in steps)
    step_s = np.array([[wait + compute for wait, compute, _ in steps] for steps in measured]).max(axis=0)
    per_s = images / float(step_s.sum())
    wait_p50, compute_p50, step_p50 = (float(np.percentile(x, 50)) for x in (waits, computes, step_s))
    alone_p50 = max(float(np.percentile(quiet, 50)) for _, quiet in ranks)
    cost_p50 = max(0.0, step_p50 - alone_p50)
    return {"images_per_s": round(per_s, 2), "images_per_s_per_rank": round(per_s / len(ranks), 2),
            "data_wait_ms_p50": round(wait_p50 * 1e3, 3), "data_wait_ms_p95": round(float(np.percentile(waits, 95)) * 1e3, 3),
            "compute_ms_p50": round(compute_p50 * 1e3, 3), "compute_ms_p95": round(float(np.percentile(computes, 95)) * 1e3, 3),
            "compute_alone_ms_p50": round(alone_p50 * 1e3, 3), "input_cost_ms_p50": round(cost_p50 * 1e3, 3),
            "input_bound": bool(cost_p50 > INPUT_BOUND_SHARE * step_p50), "steps": len(waits), "ranks": len(ranks)}


def crop_sizes(sizes: list[int]) -> dict:
    """The report's crop size of the measured steps (`sizes`: each one's): `image_size` where they all
    ran at one, else None; `image_sizes`: the sizes they ran at, in the order they ran."""
    seen = list(dict.fromkeys(sizes))
    return {"image_size": seen[0] if len(seen) == 1 else None, "image_sizes": seen}


def crop_said(sizes: list[int], image_size: int) -> str:
    """The crop size of the measured steps as the benchmark's line names it: `image_size` is
    --image-size, which a --resolution-schedule overrides epoch by epoch."""
    counts = {size: sizes.count(size) for size in dict.fromkeys(sizes)}
    if len(counts) > 1:
        return (" and ".join(f"{size} px for {n} step{'s' if n > 1 else ''}" for size, n in counts.items())
                + " (--resolution-schedule changed the crop during the measured steps: the figures mix the sizes)")
    size, = counts
    return f"{size} px" + ("" if size == image_size else f" (--resolution-schedule's crop of these steps, not "
                                                         f"--image-size {image_size})")


# flags of python -m train that the bench sets itself
BENCH_OWNS = {"--max-steps": "--warmup-steps + --steps", "--resume": "a benchmark resumes nothing",
              "--test-only": "infer measures a trained model", "--show-recipe": "a benchmark trains",
              "--eval-every": "a benchmark does not evaluate", "--save-checkpoints": "a benchmark writes no checkpoint",
              "--checkpoints": "a benchmark writes no checkpoint"}


def _given(argv: list[str], flag: str) -> bool:
    return any(arg == flag or arg.startswith(flag + "=") for arg in argv)


def _values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] if arg == flag else arg.split("=", 1)[1] for i, arg in enumerate(argv)
            if (arg == flag and i + 1 < len(argv)) or arg.startswith(flag + "=")]


def bench_train(argv: list[str]) -> int:
    ours, rest = mode_parser("train").parse_known_args(argv)
    from train.bench_hooks import ProfileTrace, StepTimer  # (after --help: these load torch)
    from train.cli import read_command
    from train.engines import detect_launch
    from train.loop import run

    for flag, why in BENCH_OWNS.items():
        if _given(rest, flag):
            raise UsageError(f"{flag} is the benchmark's to set ({why}); drop it")
    if ours.profile and ours.steps < 2:  # (the last measured step is followed by the step alone, timed again)
        raise UsageError(f"--profile traces measured steps before the last one: give --steps 2 or more, not {ours.steps}")
    synthetic = not (_given(rest, "--loader") or _given(rest, "--data-dir")) or "synthetic" in _values(rest, "--loader")
    defaults = [] if _given(rest, "--loader") or _given(rest, "--data-dir") else ["--loader", "synthetic"]
    defaults += ["--synthetic-val-images", "0"] if synthetic and not _given(rest, "--synthetic-val-images") else []
    defaults += [] if _given(rest, "--log-every") else ["--log-every", str(10 ** 9)]  # (no logging point measured)
    defaults += [] if _given(rest, "--tensorboard") or _given(rest, "--no-tensorboard") else ["--no-tensorboard"]
    rank = detect_launch().rank
    kept = _given(rest, "--out-dir")  # the logs of the benchmark's run are kept there; else in a folder removed after
    scratch = None if kept else (Path(tempfile.mkdtemp(prefix="trainer-bench-")) if rank == 0 else
                                 Path(tempfile.gettempdir()) / f"trainer-bench-rank{rank}")  # (only rank 0 writes)
    out = [] if kept else ["--out-dir", str(scratch / "run")]
    cfg, start = read_command([*defaults, *rest, *out, "--no-save-checkpoints", "--eval-every", "0",
                                "--max-steps", str(ours.warmup_steps + ours.steps)])
    timer = StepTimer(ours.warmup_steps, ours.steps)
    trace = ProfileTrace(Path(ours.profile), ours.warmup_steps, ours.steps) if ours.profile else None
    try:
        run(cfg, hooks=(timer, trace) if trace else (timer,), start=start)  # (the trace after the timer: outside its timings)
    finally:
        if trace:
            trace.close()
        if scratch is not None and rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    if timer.ranks is None:  # (alike on every rank: the run's length is the same everywhere)
        raise UsageError(f"the run ended after {len(timer.records)} step(s), before {ours.warmup_steps} warm-up and "
                         f"{ours.steps} measured steps; raise --epochs or lower --steps")
    if timer.engine.rank != 0:
        return 0
    measured_sizes = timer.sizes[ours.warmup_steps:]  # (the same on every rank: the schedule is the run's)
    report = {**train_report(timer.ranks), **crop_sizes(measured_sizes)}
    per_rank_batch = timer.ranks[0][0][0][2]  # (rank 0, its measured steps, the first, its images)
    print(f"\nbenchmark: {cfg.arch} at {crop_said(measured_sizes, cfg.image_size)}, {report['ranks']} rank(s) x batch "
          f"{per_rank_batch}, {cfg.loader} loader, {report['steps']} measured steps after {ours.warmup_steps} warm-up")
    print(f"{'per step':12s} {'p50 ms':>10s} {'p95 ms':>10s}")
    print(f"{'data wait':12s} {report['data_wait_ms_p50']:10.2f} {report['data_wait_ms_p95']:10.2f}")
    print(f"{'compute':12s} {report['compute_ms_p50']:10.2f} {report['compute_ms_p95']:10.2f}")
    print(f"{'alone':12s} {report['compute_alone_ms_p50']:10.2f} {'':>10s}   (the step again, the loader idle)")
    print(f"images/s {report['images_per_s']:.1f} in total, {report['images_per_s_per_rank']:.1f} per rank; input bound: "
          f"{'yes' if report['input_bound'] else 'no'} (the input costs the step {report['input_cost_ms_p50']:.2f} ms: "
          f"wait and slower compute, {'over' if report['input_bound'] else 'at most'} {INPUT_BOUND_SHARE:.0%} of it)")
    _write_json(Path(ours.report), report)
    print(f"report: {ours.report}")
    if trace:
        print(f"profiler trace: {trace.written} of {trace.active} measured step(s), one such file per rank"
              if trace.written else "profiler trace: none written")
    return 0


def _write_json(path: Path, value: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value, indent=2) + "\n")
    except OSError as err:
        raise UsageError(f"cannot write the report {path} ({err.strerror or err}); give a writable --report") from None


# infer ---------------------------------------------------------------------------------------------
def bench_infer(argv: list[str]) -> int:
    args = mode_parser("infer").parse_args(argv)
    import torch  # (after --help: it loads torch)

    from train.precision import Precision
    for flag in ("--arch", "--num-classes"):
        if args.source and _given(argv, flag):
            raise UsageError(f"{flag} is for an untrained model; {args.source} brings its run's own: drop {flag}")
    batch_sizes = _batch_sizes(args.batch_sizes)
    backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = [name for name in backends if name not in BACKENDS]
    if unknown or not backends:
        raise UsageError(f"unknown backend {unknown[0] if unknown else repr(args.backends)}; choose from {', '.join(BACKENDS)}")
    if "onnxruntime" in backends:
        missing = _onnx_missing()
        if missing and _given(argv, "--backends"):
            raise UsageError(f"the onnxruntime backend needs {missing}; install it or leave onnxruntime out of --backends")
        if missing:
            print(f"note: onnxruntime left out: it needs {missing}", file=sys.stderr)
            backends.remove("onnxruntime")
    if args.threads:
        torch.set_num_threads(args.threads)
    from train.engines.launch import local_device
    device = local_device(0)  # (its GPU checked to be one the installed torch has kernels for)
    model, evaluated_size, precision_name, what, evaluated_flip = _model(args, device)
    image_size = args.image_size or evaluated_size
    flip = evaluated_flip if args.flip is None else args.flip
    precision = Precision(args.precision or precision_name, device)
    print(f"inference benchmark: {what} at {_size_said(args, image_size, evaluated_size)}, "
          f"{_passes_said(flip, evaluated_flip, bool(args.source))}, {precision.name} on {device.type}, "
          f"{torch.get_num_threads()} thread(s); {args.warmup_iterations} warm-up and {args.iterations} timed calls "
          f"per batch size")
    if "onnxruntime" in backends and precision.name != "fp32":
        print(f"note: onnxruntime runs the exported fp32 model, not {precision.name}")
    results = []
    with tempfile.TemporaryDirectory(prefix="trainer-bench-infer-") as scratch:
        for backend in backends:
            call = _backend(backend, model, image_size, precision, device, Path(scratch), flip)
            for batch in batch_sizes:
                results.append(_measure(backend, call, batch, image_size, device, args.warmup_iterations, args.iterations))
                _print_row(results[-1], header=len(results) == 1)
    report = Path(args.report)
    _write_json(report, {"image_size": image_size, "flip": flip, "results": results})
    figure = report.with_suffix(".png")
    plot(results, figure, f"{what} at {image_size} px{', flip: two passes' if flip else ''}, {precision.name} "
                          f"on {device.type}")
    print(f"report: {report}, figure: {figure}")
    return 0


def _size_said(args, image_size: int, evaluated_size: int) -> str:
    """The input size as the header names it, and where it differs from the run's evaluation."""
    if args.source and image_size != evaluated_size:
        return f"{image_size} px (--image-size; the run evaluates at {evaluated_size} px)"
    return f"{image_size} px"


def _passes_said(flip: bool, evaluated_flip: bool, trained: bool) -> str:
    """The model's passes per batch as the header names them, against the run's evaluation."""
    if flip:
        how = "as the run's evaluation" if evaluated_flip else "--flip"
        return f"two passes per batch ({how}: the images and their mirror images, the logits averaged)"
    if evaluated_flip:
        return "one pass per batch (--no-flip; the run's evaluation takes two: the images and their mirror images)"
    return "one pass per batch" + (" (as the run's evaluation)" if trained else "")


def _batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--batch-sizes {text!r}: give whole numbers separated by commas, e.g. 1,8,32") from None
    bad = [size for size in sizes if size < 1]
    if bad or not sizes:
        raise UsageError(f"--batch-sizes {text!r}: a batch size must be at least 1, got {bad[0] if bad else 'none'}")
    return sizes


def _onnx_missing() -> str:
    """What the onnxruntime backend lacks ("" when nothing)."""
    import importlib.util
    if importlib.util.find_spec("onnxruntime") is None:
        return "the onnxruntime package (not installed)"
    try:
        from train.export import export_onnx  # noqa: F401
    except ImportError:
        return "train.export (not installed)"
    return ""


def _model(args, device: torch.device):
    """(model in eval mode, image size, precision name, what it is, flip): the source's, or an untrained
    --arch at 224 px, evaluated in one pass."""
    import torch

    from models import build_model
    if args.source:
        model, image_size, precision_name, what, flip = _trained(args.source, device)
    else:
        torch.manual_seed(0)
        model = build_model(args.arch, args.num_classes, channels_last=True).to(device)
        image_size, precision_name, what, flip = 224, "auto", f"untrained {args.arch}", False
    return model.eval().to(memory_format=torch.channels_last), image_size, precision_name, what, flip


def _trained(source: str, device: torch.device):
    """(model, evaluation size, precision name, what it is, whether its evaluation averages each image's
    logits with its mirror image's: --eval-flip) of a checkpoint file or a run directory."""
    if not Path(source).exists():
        raise UsageError(f"{source} does not exist; give a checkpoint file or a run directory")
    try:
        from train.inference import load_trained
    except ImportError:
        raise UsageError("loading a checkpoint needs train.inference (not installed)") from None
    trained = load_trained(source, device)
    what = f"{trained.arch} from {trained.checkpoint}"
    return trained.model, trained.image_size, trained.precision, what, trained.flip


def _backend(name: str, model, image_size: int, precision, device: torch.device, scratch: Path, flip: bool = False):
    """A function of a batch on the device that runs the model on `name` and returns its logits; with
    `flip` as an evaluation with --eval-flip takes them: the mean of the batch's and its mirror images'
    (train/inference.py evaluated_logits)."""
    import torch

    from train.inference import evaluated_logits
    if name in ("eager", "compile"):
        if name == "compile":  # (a GPU-less host with nvcc: "No CUDA runtime", as the trainer says none)
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
        module = torch.compile(model, dynamic=False) if name == "compile" else model  # (one graph per batch size)

        def call(images):
            with torch.inference_mode(), precision.autocast():
                return evaluated_logits(module, images, flip)
        return call
    import onnxruntime
    from train.export import export_onnx
    path = scratch / "model.onnx"
    export_onnx(model, image_size, path)
    providers = (["CUDAExecutionProvider"] if device.type == "cuda" and "CUDAExecutionProvider" in
                 onnxruntime.get_available_providers() else []) + ["CPUExecutionProvider"]
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()  # (the same threads as the other backends)
    session = onnxruntime.InferenceSession(str(path), options, providers=providers)
    input_name = session.get_inputs()[0].name

    def one_pass(images):  # (the exported graph takes fp32 NCHW: the time includes the copy to the host on a GPU)
        return session.run(None, {input_name: images.float().contiguous().cpu().numpy()})[0]

    return lambda images: evaluated_logits(one_pass, images, flip)


def _measure(backend: str, call, batch: int, image_size: int, device: torch.device, warmup: int, iterations: int) -> dict:
    import numpy as np
    import torch
    generator = torch.Generator().manual_seed(batch)
    images = torch.randn(batch, 3, image_size, image_size, generator=generator).to(device)
    images = images.contiguous(memory_format=torch.channels_last)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        call(images)
    seconds = []
    for _ in range(iterations):
        sync()
        start = time.perf_counter()
        call(images)
        sync()
        seconds.append(time.perf_counter() - start)
    ms = np.array(seconds) * 1e3
    latency = {f"latency_ms_p{q}": round(float(np.percentile(ms, q)), 4) for q in PERCENTILES}
    return {"backend": backend, "batch_size": batch, **latency, "images_per_s": round(batch * iterations / sum(seconds), 2)}


def _print_row(row: dict, header: bool) -> None:
    if header:
        print(f"{'backend':12s} {'batch':>6s} " + " ".join(f"{f'p{q} ms':>10s}" for q in PERCENTILES) + f" {'images/s':>10s}")
    print(f"{row['backend']:12s} {row['batch_size']:6d} " + " ".join(f"{row[f'latency_ms_p{q}']:10.2f}" for q in PERCENTILES)
          + f" {row['images_per_s']:10.1f}", flush=True)


def plot(results: list[dict], path: Path, title: str) -> None:
    """Latency (p50, with the p99 dashed) and images/s against batch size, one line per backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for backend in dict.fromkeys(row["backend"] for row in results):
        rows = [row for row in results if row["backend"] == backend]
        sizes = [row["batch_size"] for row in rows]
        line, = left.plot(sizes, [row["latency_ms_p50"] for row in rows], marker="o", label=f"{backend} p50")
        left.plot(sizes, [row["latency_ms_p99"] for row in rows], linestyle="--", color=line.get_color(),
                  label=f"{backend} p99")
        right.plot(sizes, [row["images_per_s"] for row in rows], marker="o", label=backend)
    sizes = sorted({row["batch_size"] for row in results})
    for axes, label in ((left, "latency (ms)"), (right, "images/s")):
        axes.set_xscale("log", base=2)
        axes.set_xticks(sizes, [str(size) for size in sizes])
        axes.set_xlabel("batch size")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    left.set_yscale("log")
    fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except OSError as err:
        raise UsageError(f"cannot write the figure {path} ({err.strerror or err}); give a writable --report") from None
    finally:
        plt.close(fig)


# the command ---------------------------------------------------------------------------------------
MODES = {"train": bench_train, "infer": bench_infer}  # (their flags: train/bench_flags.py)


def main(argv: list[str] | None = None) -> int:
    from data.tree import DataError
    from train.errors import Preempted, RunAborted
    argv = sys.argv[1:] if argv is None else argv
    try:
        if not argv or argv[0] not in MODES:
            if argv and argv[0] in ("-h", "--help"):
                parser().print_help()
                return 0
            raise UsageError(f"give a mode: python -m train.bench train [flags] or python -m train.bench infer "
                             f"[CHECKPOINT_OR_RUN] [flags]{f', not {argv[0]!r}' if argv else ''}")
        return MODES[argv[0]](argv[1:])
    except (UsageError, DataError) as err:  # (errors raised on every rank: printed once, by rank 0)
        from train.engines import detect_launch
        if detect_launch().rank == 0 or not getattr(err, "raised_everywhere", False):
            print(f"error: {err}", file=sys.stderr)
        return 2
    except RunAborted as err:
        print(f"error: {err}", file=sys.stderr)
        return 3
    except Preempted:
        return 75


if __name__ == "__main__":
    sys.exit(main())
