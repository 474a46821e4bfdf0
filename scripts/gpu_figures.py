"""The GPU check's figures (scripts/gpu_check.sh runs this on a GPU node; on a CPU it runs at toy sizes,
for the check's dry run and its own tests). One figure after another, the most useful first, each
printed as soon as it is measured and the JSON written again after each, so that a check cut short
still shows what it measured:

1. `synthetic P`: training images/s on one GPU at the default per-GPU batch in the default precision P
   (bf16 from compute capability 8.0, else fp16), on synthetic data, with the peak GPU memory per
   image, under the sync check: from step UNCHECKED_STEPS + 1 on, the steps run under
   torch.cuda.set_sync_debug_mode("error"), so a step that waits for the GPU (a host read, a blocking
   copy) ends the run and the row names the line (a hook of the loop: SyncCheck).
2. `synthetic P --compile`: step time against eager, and the compile time (its first window's extra
   seconds beyond the eager run's); second, as the figure that needs the most time.
3. `trace P`: `python -m train.bench train --profile` on one GPU: the step's profiler trace, and from
   it the LARS step's kernels (those launched inside the "optimizer" range).
4. `dali P` and `dali feed`: training through DALI decoding generated JPEGs (made by a background
   process while the runs before train), and DALI's batches alone (its rate, no step); `DALI absent`
   where DALI is not installed, and then no JPEG is written.
5. `2 GPUs P`: where two GPUs are visible, the same benchmark on 2 ranks under torchrun (NCCL): its
   images/s per GPU against one GPU's, and its trace (the one kept); on one GPU a row says so.
6. `synthetic fp16`: the loss scaler's step under the sync check.
7. `horovod P`: Horovod's asynchronous completion: the host's time in the "all-reduce" range per step
   with it (the engine's choice on CUDA) and without (HOROVOD_ENABLE_ASYNC_COMPLETION=0);
   `Horovod absent` where Horovod is not installed.
8. `synthetic fp32` (TF32 on Ampere and newer), then the ghost BatchNorm step against plain.
Then the planner's images/s for this GPU beside the measured, and published anchors.

A figure starts only with the time it needs left before --deadline-s; at the deadline the one running
is stopped (SIGALRM) and the rest are reported as not run. Every run's files go under --work.

    python scripts/gpu_figures.py --work DIR --json FILE [--trace FILE] [--calibration FILE] [--deadline-s S]
                                  [--arch resnet50 --image-size 224 --steps 40] [--skip NAME,...]
    python scripts/gpu_figures.py --make-jpegs DIR --jpegs N     (the JPEG maker the DALI runs start)
"""
import argparse
import contextlib
import datetime
import gc
import gzip
import importlib.util
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

STARTED = time.time()  # --deadline-s counts from here: the shell's timeout counts from the process's start
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from train.hooks import LoopHooks  # noqa: E402  (imports nothing: --make-jpegs runs without torch)
from train.rundir import RunDir  # noqa: E402  (no torch either)

# single-GPU anchors, published: what -> images/s
ANCHORS = {"A100-80GB, AMP, NVIDIA DeepLearningExamples PyTorch, batch 256": 2470,
           "H200, MLPerf Training v4.0 (8 GPUs, per GPU), MXNet, batch 400": 7950}
UNCHECKED_STEPS = 3  # the first steps may wait (cuDNN's autotuning, the first step's host-memory reserve)
PLANNER_GPUS = ("h200", "h100", "a100", "v100")
# seconds a figure needs on a GPU (start-up included) to start before the deadline; on a CPU, toy sizes
NEEDS_S = {"synthetic": 25, "trace": 30, "dali": 40, "two-gpus": 50, "compile": 100, "horovod": 70, "ghost-bn": 45}
SKIPPABLE = ("dali", "two-gpus", "compile", "horovod", "ghost-bn")


class OutOfTime(BaseException):
    """The deadline passed (SIGALRM): whatever runs stops. (Not an Exception: nothing in the trainer may
    take it for a failure of its own.)"""


def _out_of_time(signum, frame):
    raise OutOfTime()


# the sync check ----------------------------------------------------------------------------------
class SyncCheck(LoopHooks):
    """torch.cuda.set_sync_debug_mode("error") over each step after the first UNCHECKED_STEPS, from
    asking the loader for its batch (but for an epoch's first batch, for which a loader may set up) to
    the step's end and what follows until the host may read again; off where it may (logging points,
    epoch ends, evaluations, checkpoints, the end), and after the run."""

    def run_started(self, training) -> None:
        self.state, self.reading = training.state, 0

    def batch_asked(self) -> None:
        if not self.reading and self.state.step >= UNCHECKED_STEPS and self.state.step_in_epoch > 0:
            _sync_debug_mode("error")

    def reads_start(self, what: str) -> None:
        self.reading += 1
        _sync_debug_mode(0)

    def reads_end(self, what: str) -> None:
        self.reading -= 1


def _sync_debug_mode(mode) -> None:
    import torch
    torch.cuda.set_sync_debug_mode(mode)


def train(run_dir: Path, argv: list[str], sync_check: bool) -> dict:
    """One run of the trainer in this process: its steady images/s (after the first logging window),
    the seconds of that first window beyond the steady rate (compiling, autotuning), its peak GPU
    memory, its per-GPU batch and header, or why it failed and where."""
    import torch
    from train.cli import parse
    from train.loop import run
    out = io.StringIO()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    failure = ""
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            cfg = parse(["--out-dir", str(run_dir), "--eval-every", "0", "--no-save-checkpoints", "--no-tensorboard", *argv])
            run(cfg, hooks=(SyncCheck(),) if sync_check else ())
    except Exception as error:  # (the sync check's own is a RuntimeError: the step waited for the GPU)
        failure = _where(error)
    finally:
        if sync_check:
            _sync_debug_mode(0)
        gc.unfreeze()  # (the loop freezes its long-lived objects; let them go before the next run)
        gc.collect()
    header = next((line for line in out.getvalue().splitlines() if line.startswith("training ")), "")
    if failure:
        return {"failed": failure, "header": header}
    windows = [json.loads(line) for line in RunDir(run_dir).metrics.read_text().splitlines()]
    windows = [w for w in windows if w["kind"] == "train"]
    first, last = windows[0], windows[-1]
    rate = (last["images"] - first["images"]) / (last["seconds"] - first["seconds"])
    batch = _config(run_dir)["batch_size"]
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    return {"img_per_s": round(rate, 1), "first_window_extra_s": round(first["seconds"] - first["images"] / rate, 1),
            "batch": batch, "peak_memory_gib": round(peak / 2 ** 30, 2),
            "peak_memory_mib_per_image": round(peak / 2 ** 20 / batch, 1), "header": header}


def _config(run_dir: Path) -> dict:
    import yaml
    return yaml.safe_load(RunDir(run_dir).config.read_text())


def _where(error: BaseException) -> str:
    """A failure in a line: the sync check's (synchronised), or any other error's type, with the innermost
    line of the trainer's code that led to it."""
    ours = tuple(str(REPO / package) for package in ("train", "models", "data"))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(ours)]
    place = f" at {Path(frames[-1].filename).relative_to(REPO)}:{frames[-1].lineno}" if frames else ""
    said = (str(error).strip().splitlines() or [""])[0][:300]
    kind = "synchronised" if "synchronizing CUDA operation" in said else type(error).__name__
    return f"{kind}{place}: {said}"


# the benchmark's runs: one GPU in this process, two under torchrun, Horovod under horovodrun ----------
def bench(work: Path, name: str, argv: list[str], launcher: list[str] | None = None, env: dict | None = None,
          timeout: float = 0) -> dict:
    """`python -m train.bench train ARGV --profile` (in this process, or under `launcher`, the command
    line before the module's name): its report, and rank 0's trace."""
    report, traces = work / f"{name}.json", work / f"{name}-traces"
    flags = ["train", *argv, "--report", str(report), "--profile", str(traces)]
    if launcher is None:
        from train.bench import main as bench_main
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = bench_main(flags)
        finally:
            gc.unfreeze()  # (as after train())
            gc.collect()
        said = out.getvalue()
    else:
        code, said = run_child([*launcher, "train.bench", *flags], timeout, env)
    trace = traces / "trace-rank0.json.gz"
    if code != 0 or not report.is_file() or not trace.is_file():
        (work / f"{name}.log").write_text(said)
        return {"failed": f"exit {code}: {_last_error(said)}"}
    return {"report": json.loads(report.read_text()), "trace": trace}


def _last_error(said: str) -> str:
    """The line of a command's output that says what went wrong: its last error line, else its last line."""
    lines = [line.strip() for line in said.splitlines() if line.strip().strip("=*-")]
    raised = [line for line in lines if re.match(r"[\w.]*(Error|Exception): \S", line)]  # (a launcher's own is empty)
    errors = [line for line in lines if re.search(r"Error\b|error:|Exception\b", line)]
    return ((raised or errors or lines or ["no output"])[-1])[:300]


def run_child(command: list[str], timeout: float, env: dict | None = None) -> tuple[int, str]:
    """A launcher and its ranks in a session of their own, killed whole at the timeout or the deadline.
    This process's cached GPU memory is given back first: its ranks need all of their GPUs'."""
    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True, env={**os.environ, "PYTHONPATH": path, **(env or {})})
    try:
        said, _ = child.communicate(timeout=max(1.0, timeout))
        return child.returncode, said
    except subprocess.TimeoutExpired:
        return 124, f"over {timeout:.0f} s"
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def range_figures(trace: Path, name: str) -> dict:
    """Per step of a profiler trace, what ran inside the named range on the host thread that opened
    it: the GPU kernels its calls launched (matched to their launches by correlation id), its
    foreach and fused calls, and the host's time in it (ms)."""
    with gzip.open(trace, "rt") as file:
        events = [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X"]
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"] == name]
    if not ranges:
        return {"steps": 0}

    def inside(event) -> bool:
        return any(r["pid"] == event.get("pid") and r["tid"] == event.get("tid") and r["ts"] <= event["ts"]
                   and event["ts"] + event.get("dur", 0) <= r["ts"] + r["dur"] for r in ranges)
    launches = {e["args"]["correlation"] for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {}) and inside(e)}
    kernels = sum(e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launches for e in events)
    calls = sum(e.get("cat") == "cpu_op" and re.match(r"aten::_(foreach|fused)_", e["name"]) is not None and inside(e)
                for e in events)
    steps = len(ranges)
    return {"steps": steps, "kernels_per_step": round(kernels / steps, 1), "calls_per_step": round(calls / steps, 1),
            "host_ms_per_step": round(sum(r["dur"] for r in ranges) / steps / 1e3, 3)}


# DALI ----------------------------------------------------------------------------------------------
def dali_state() -> str:
    """"present", "DALI absent" (not installed), or why an installed DALI does not load."""
    try:
        import nvidia.dali  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name in ("nvidia", "nvidia.dali"):
            return "DALI absent"
        return f"DALI broken: {err}"
    except Exception as err:  # installed, but it does not load here
        return f"DALI broken: {type(err).__name__}: {err}"
    return "present"


def make_jpegs(root: Path, images: int) -> None:
    """`images` training JPEGs in 8 classes (and 8 to validate) about ImageNet's size and weight (500 x
    375, ~100 KB: a gradient with noise, as photos compress), on all but two of the cores."""
    from multiprocessing import Pool
    jobs = [(root, "train", i) for i in range(images)] + [(root, "val", i) for i in range(8)]
    with Pool(max(1, (os.cpu_count() or 2) - 2)) as pool:
        pool.starmap(_jpeg, jobs, chunksize=16)
    (root / "done").write_text(f"{images}\n")


def _jpeg(root: Path, split: str, i: int) -> None:
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(i)
    h, w = (375, 500) if rng.random() < 0.7 else (500, 375)
    y, x = np.mgrid[0:h, 0:w]
    pixels = np.stack([x * 255 / w, y * 255 / h, (x + y) * 127 / (w + h)], -1) + rng.normal(0, 24, (h, w, 3))
    folder = root / split / f"class{i % 8}"
    folder.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(folder / f"{i:05d}.JPEG", quality=90)


def dali_feed(run_dir: Path, argv: list[str], epochs: int = 3) -> dict:
    """DALI's training batches alone, no step: images/s over `epochs` epochs after the first batch (the
    pipeline's start), the device synchronised at both ends (start-up as a run's: train/startup.py)."""
    import torch
    from train.cli import parse
    from train.startup import prepare
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        setup = prepare(parse(["--out-dir", str(run_dir), "--eval-every", "0", "--no-save-checkpoints", "--no-tensorboard",
                               *argv]))
    sync = torch.cuda.synchronize if setup.engine.device.type == "cuda" else (lambda: None)
    try:
        started, images = None, 0
        for epoch in range(epochs):
            for images_on_device, labels in setup.loader.train_batches(epoch, 0, True):
                if started is None:
                    sync()
                    started = time.perf_counter()
                else:
                    images += labels.shape[0]
        sync()
        return {"img_per_s": round(images / (time.perf_counter() - started), 1), "batch": setup.cfg.batch_size}
    finally:
        setup.loader.close()
        if setup.lock:
            setup.lock.release()
        setup.engine.shutdown()


# the figures in order -----------------------------------------------------------------------------
class Figures:
    """The check's figures as they are measured: the JSON written again after each, each row printed."""

    def __init__(self, args, device_figures: dict):
        self.args, self.started = args, STARTED
        self.figures = {**device_figures, "runs": [], "anchors": ANCHORS}
        self.cuda = device_figures["sync_checked"]

    def left(self) -> float:
        return self.args.deadline_s - (time.time() - self.started)

    def can_start(self, need: str) -> str:
        """"" when the figure may start, else why not."""
        needed = NEEDS_S[need] if self.cuda else 5
        if need in self.args.skip:
            return f"not run (--skip {need})"
        left = self.left()
        return "" if left >= needed else f"not run: {max(0, left):.0f} s left of the check's time, it needs about {needed}"

    def add(self, row: dict) -> dict:
        self.figures["runs"].append(row)
        print(row_line(row, self.figures), flush=True)
        self.save()
        return row

    def save(self) -> None:
        self.args.json.write_text(json.dumps(self.figures, indent=1, default=str))

    def measure(self, label: str, need: str, function, **row) -> dict:
        """A row: `function()`'s figures, or why it was not run, failed or was cut at the deadline."""
        row = {"run": label, **row}
        why = self.can_start(need)
        if why:
            return self.add({**row, "not_run": why})
        started = time.time()
        try:
            row.update(function())
        except OutOfTime:
            row["not_run"] = f"cut at the check's deadline after {time.time() - started:.0f} s"
        except Exception as error:
            row["failed"] = _where(error)
        return self.add(row)


def row_line(r: dict, figures: dict) -> str:
    """One row of the table, as printed."""
    label = f"{r['run']:<30}"
    if "failed" in r:
        return f"{label} FAILED: {r['failed']}"
    for kind in ("absent", "not_run", "said"):
        if kind in r:
            return f"{label} {r[kind]}"
    checked = f"no sync after step {UNCHECKED_STEPS}" if figures["sync_checked"] else "sync not checked (no GPU)"
    loader = re.split(r" \| ", r["header"])[-2] if r["header"].count(" | ") >= 2 else "?"
    return (f"{label} batch {r['batch']:>4} {r['img_per_s']:>9,.0f} img/s  peak {r['peak_memory_gib']:6.2f} GiB "
            f"{r['peak_memory_mib_per_image']:6.1f} MiB/img  {checked} / {loader}")


def run_figures(f: Figures, sizes: list[str], default: str, jpeg_maker) -> None:
    """Every figure, the most useful first (see the module's docstring). `sizes`: the model, its image
    size and a per-GPU batch if one is given."""
    args, work, cuda = f.args, f.args.work, f.cuda
    common = [*sizes, "--log-every", str(max(2, args.steps // 4))]  # the trainer's runs: 4 logging windows
    synthetic = ["--loader", "synthetic", "--synthetic-images", "10000000", "--synthetic-val-images", "0",
                 "--max-steps", str(args.steps), "--workers", "0"]

    def training(label: str, precision: str, extra: list[str], need: str = "synthetic") -> dict:
        return f.measure(label, need, lambda: train(work / label.replace(" ", "-"),
                                                    [*common, "--precision", precision, *extra], cuda))
    eager = training(f"synthetic {default}", default, synthetic)
    # second: the figure that needs the most time (a cold compile of forward and backward)
    lacking = triton_lacks() if cuda else ""
    if lacking:
        compiled = f.add({"run": f"synthetic {default} --compile", "not_run": f"not run: {lacking}"})
    else:
        compiled = training(f"synthetic {default} --compile", default, [*synthetic, "--compile"], "compile")
    if "img_per_s" in compiled and "img_per_s" in eager:  # (the eager run's first window: start-up and autotuning)
        f.figures["compile"] = {"step_time_vs_eager": round(eager["img_per_s"] / compiled["img_per_s"], 3),
                                "compile_s": round(compiled["first_window_extra_s"] - eager["first_window_extra_s"], 1)}
    # the benchmark's runs at the batch the trainer chose (common holds a --batch-size given), with no
    # logging point among their steps (the benchmark's own choice)
    batch = ["--batch-size", str(eager["batch"])] if "batch" in eager and not args.batch_size else []
    f.figures["batch"] = eager.get("batch")
    bench_flags = [*sizes, *batch, "--precision", default, "--warmup-steps", "5" if cuda else "1",
                   "--steps", "4" if cuda else "3"]
    one = f.measure(f"trace {default}", "trace", lambda: trace_row(work, bench_flags, cuda))
    dali_rows(f, common, default, jpeg_maker)
    gpus = f.figures["gpus"]
    if gpus < 2 and not args.two_ranks:
        two = f.add({"run": f"2 GPUs {default}", "said": f"{gpus} GPU(s) visible: no 2-GPU stage"})
    else:
        two = f.measure(f"2 GPUs {default}", "two-gpus", lambda: two_ranks_row(f, work, bench_flags, one))
    if cuda and default != "fp16":  # (below compute capability 8.0 fp16 is the default, measured first)
        training("synthetic fp16", "fp16", synthetic)
    horovod_row(f, work, bench_flags)
    if default != "fp32":
        training("synthetic fp32", "fp32", synthetic)
    f.measure("ghost BatchNorm", "ghost-bn", lambda: {"said": ghost_bn_ratio(args, min(150, f.left()))})
    kept = two.get("trace") or one.get("trace")  # the 2-GPU stage's where it ran: it holds the all-reduce too
    if kept and args.trace:
        shutil.copyfile(kept, args.trace)
        f.figures["trace"] = {"file": args.trace.name, "of": two["run"] if two.get("trace") else one["run"]}


def triton_lacks() -> str:
    """What this node lacks to build the small C modules that Triton (torch.compile's GPU kernels)
    compiles at its first use: a C compiler ($CC, else gcc or clang) and Python's headers ("" when
    it lacks nothing)."""
    import sysconfig
    if not (shutil.which(os.environ["CC"]) if os.environ.get("CC") else shutil.which("gcc") or shutil.which("clang")):
        return "no C compiler ($CC, gcc or clang), which torch.compile's GPU kernels (Triton) need"
    scheme = sysconfig.get_default_scheme()
    headers = Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])
    if not (headers / "Python.h").is_file():
        return f"no {headers}/Python.h (the python's development headers), which Triton needs"
    return ""


def trace_row(work: Path, flags: list[str], cuda: bool) -> dict:
    done = bench(work, "trace", [*flags, "--loader", "synthetic"])
    if "failed" in done:
        return done
    lars, report = range_figures(done["trace"], "optimizer"), done["report"]
    kernels = (f"{lars['kernels_per_step']:g} kernels per step" if cuda else "no GPU kernels (CPU)")
    said = (f"LARS step (the \"optimizer\" range): {kernels}, {lars['calls_per_step']:g} foreach/fused calls, "
            f"over {lars['steps']} profiled steps; {report['images_per_s']:,.0f} img/s (data wait "
            f"{report['data_wait_ms_p50']:.2f} ms, compute {report['compute_ms_p50']:.1f} ms p50)")
    return {"said": said, "lars_step": lars, "bench": report, "trace": done["trace"]}


def dali_rows(f: Figures, common: list[str], default: str, jpeg_maker) -> None:
    """The DALI run and DALI's feed alone, or a row each saying DALI is absent (or broken)."""
    state, labels = dali_state(), (f"dali {default}", "dali feed")
    if "dali" in f.args.skip:
        for label in labels:
            f.add({"run": label, "not_run": "not run (--skip dali)"})
        return
    if state != "present":
        for label in labels:
            f.add({"run": label, "absent" if state == "DALI absent" else "failed": state})
        return
    jpegs = f.args.work / "jpegs"

    def jpegs_made() -> None:
        jpeg_maker.wait(timeout=max(1.0, f.left()))
        if not (jpegs / "done").is_file():
            raise RuntimeError(f"the JPEG maker failed (exit {jpeg_maker.returncode})")

    def dali_training() -> dict:
        jpegs_made()
        return train(f.args.work / "dali", [*common, "--precision", default, "--loader", "dali", "--data-dir",
                                            str(jpegs), "--epochs", "1000", "--max-steps", str(f.args.steps)], f.cuda)
    trained = f.measure(labels[0], "dali", dali_training, loader="dali")
    batch = ["--batch-size", str(trained["batch"])] if "batch" in trained and not f.args.batch_size else []
    f.measure(labels[1], "dali", lambda: feed_said(dali_feed(f.args.work / "dali-feed", [
        *common, *batch, "--precision", default, "--loader", "dali", "--data-dir", str(jpegs)])))


def feed_said(feed: dict) -> dict:
    return {**feed, "said": f"{feed['img_per_s']:,.0f} img/s: DALI's training batches alone (batch {feed['batch']}, "
                            "no step)"}


def two_ranks_row(f: Figures, work: Path, flags: list[str], one: dict) -> dict:
    """The benchmark on 2 ranks under torchrun: per rank against the one-GPU run (on a CPU, with
    --two-ranks, 2 processes over gloo)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m"]
    done = bench(work, "two", [*flags, "--loader", "synthetic"], torchrun, timeout=f.left())
    if "failed" in done:
        return done
    report = done["report"]
    single = one.get("bench", {}).get("images_per_s")
    scaling = round(report["images_per_s_per_rank"] / single, 3) if single else None
    said = (f"{report['images_per_s']:,.0f} img/s over 2 ranks (torchrun), {report['images_per_s_per_rank']:,.0f} per "
            f"rank" + (f" = {scaling:.3f} x one GPU's" if scaling else "") + "; trace kept")
    return {"said": said, "bench": report, "scaling": scaling, "trace": done["trace"]}


def horovod_row(f: Figures, work: Path, flags: list[str]) -> None:
    """The host's time in the all-reduce per step, with Horovod's asynchronous completion and without."""
    label = f"horovod {flags[flags.index('--precision') + 1]}"
    if importlib.util.find_spec("horovod") is None:
        f.add({"run": label, "absent": "Horovod absent"})
        return
    import torch
    ranks = str(min(2, max(1, torch.cuda.device_count())))
    horovodrun = [sys.executable, "-m", "horovod.runner.launch", "-np", ranks, "-H", f"localhost:{ranks}",
                  sys.executable, "-m"]

    def both() -> dict:
        waits = {}
        for name, env in (("async", {}), ("blocking", {"HOROVOD_ENABLE_ASYNC_COMPLETION": "0"})):
            done = bench(work, f"horovod-{name}", [*flags, "--loader", "synthetic", "--engine", "horovod"], horovodrun, env,
                         timeout=f.left())  # (--engine: one rank under mpirun would be taken for a plain process)
            if "failed" in done:
                return done
            waits[name] = range_figures(done["trace"], "all-reduce").get("host_ms_per_step")
            if waits[name] is None:
                return {"failed": "no \"all-reduce\" range in the trace of the horovod engine's step"}
        said = (f"host in the \"all-reduce\" range {waits['async']} ms per step with asynchronous completion (the "
                f"engine's on CUDA), {waits['blocking']} ms with HOROVOD_ENABLE_ASYNC_COMPLETION=0 ({ranks} rank(s))")
        return {"said": said, "host_ms_per_step": waits}
    f.measure(label, "horovod", both)


def ghost_bn_ratio(args, seconds: float) -> str:
    """scripts/bench/ghost_bn.py's headline on this device, or why there is none."""
    import torch
    sizes = ["--arch", args.arch, "--image-size", str(args.image_size)] + (
        ["--batch-size", str(args.batch_size), "--steps", "3", "--warmup", "1"] if args.batch_size else [])
    code, said = run_child([sys.executable, str(REPO / "scripts" / "bench" / "ghost_bn.py"), "--device",
                            "cuda" if torch.cuda.is_available() else "cpu", *sizes], seconds)
    lines = said.strip().splitlines() or ["no output"]
    return f"step with 2 ghost groups against plain: {lines[-1]}" if code == 0 else f"failed: {lines[-1][:300]}"


def planner_img_s(gpu: str, batch: int, image_size: int) -> float | None:
    """The planner's images/s for one GPU of this kind at this batch (None: another image size than
    its 224 px)."""
    if image_size != 224:
        return None
    from train.plan.cli import parser, plans, system_of
    args = parser().parse_args(["--gpu", gpu, "--gpus", "1", "--per-gpu-batch", str(batch)])
    return round(plans(system_of(args), [1])[0][0]["img_per_s_per_gpu"], 1)


def summary(figures: dict) -> list[str]:
    """The lines after the rows: compile against eager, the planner, the anchors."""
    lines = []
    if "compile" in figures:
        c = figures["compile"]
        lines.append(f"--compile (default mode): step time {c['step_time_vs_eager']:.3f} x eager's, compile about "
                     f"{c['compile_s']:.0f} s")
    eager = next((r for r in figures["runs"] if r["run"] == f"synthetic {figures['default_precision']}"
                  and "img_per_s" in r), None)
    gpu = next((g for g in PLANNER_GPUS if g in figures["gpu"].lower()), None)
    if eager:
        predicted = planner_img_s(gpu, eager["batch"], figures["image_size"]) if gpu else None
        figures["planner"] = {"gpu": gpu, "batch": eager["batch"], "measured_img_s": eager["img_per_s"],
                              "predicted_img_s": predicted}
        lines.append(f"planner ({gpu or figures['gpu']}, batch {eager['batch']}): " + (
            f"{predicted:,.0f} img/s predicted" if predicted else "no prediction (a GPU or image size the planner "
            "has no figures for)") + f", {eager['img_per_s']:,.0f} img/s measured")
    return lines + [f"published: {what}: {rate:,} img/s" for what, rate in figures["anchors"].items()]


def calibration(figures: dict) -> str:
    """The default precision's point in the form of train/plan/calibration.yaml's `measured:` list."""
    run = next((r for r in figures["runs"] if r["run"] == f"synthetic {figures['default_precision']}"
                and "img_per_s" in r), None)
    if run is None:
        return "# no point: the default precision's synthetic run was not measured\n"
    today = datetime.date.today()
    gpu = next((g for g in PLANNER_GPUS if g in figures["gpu"].lower()), "unknown")
    note = "" if figures["sync_checked"] else "# a dry run on a CPU: no GPU figure, not for calibration\n"
    return (f"{note}measured:  # scripts/gpu_check.sh {today} on {figures['gpu']}; into train/plan/calibration.yaml\n"
            f"  - {{gpu: {gpu}, per_gpu_batch: {run['batch']}, img_per_s: {run['img_per_s']}, "
            f"source: \"gpu_check {today}, {figures['default_precision']}\"}}\n")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="a folder for the runs, JPEGs and traces")
    parser.add_argument("--json", type=Path, help="the figures' JSON (written after each figure)")
    parser.add_argument("--trace", type=Path, help="where the one kept profiler trace goes (.json.gz)")
    parser.add_argument("--calibration", type=Path, help="where the planner's calibration point goes")
    parser.add_argument("--deadline-s", type=float, default=200, help="seconds from start: no figure runs past it")
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=40, help="steps of each timed run")
    parser.add_argument("--jpegs", type=int, default=4096, help="generated JPEGs for the DALI runs")
    parser.add_argument("--batch-size", type=int, default=0, help="per-GPU batch (0: the trainer's default)")
    parser.add_argument("--two-ranks", action="store_true", help="run the 2-rank stage whatever the GPUs (a dry run: "
                        "2 processes on the CPU)")
    parser.add_argument("--skip", default="", help=f"comma-separated, of {', '.join(SKIPPABLE)}")
    parser.add_argument("--make-jpegs", type=Path, help="only make --jpegs JPEGs in this folder")
    args = parser.parse_args()
    args.skip = set(filter(None, args.skip.split(",")))
    if args.skip - set(SKIPPABLE):
        parser.error(f"--skip {','.join(sorted(args.skip - set(SKIPPABLE)))}: choose from {', '.join(SKIPPABLE)}")
    if not args.make_jpegs and not (args.work and args.json):
        parser.error("give --work and --json")
    return args


def main() -> int:
    args = parse_args()
    if args.make_jpegs:
        make_jpegs(args.make_jpegs, args.jpegs)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    jpeg_maker = None  # started first, on its own cores, while the synthetic runs train
    if "dali" not in args.skip and dali_state() == "present":
        jpeg_maker = subprocess.Popen([sys.executable, __file__, "--make-jpegs", str(args.work / "jpegs"), "--jpegs",
                                       str(args.jpegs)], stdout=subprocess.DEVNULL, preexec_fn=lambda: os.nice(10))
    import torch
    from train.precision import BF16_CAPABILITY, resolve
    # at the deadline, or told to end (the check's own timeout), the figure running is cut and its launcher's
    # ranks killed (run_child), so that nothing is left on the GPUs
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.signal(signal.SIGTERM, _out_of_time)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, args.deadline_s - (time.time() - STARTED)))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    capability = tuple(torch.cuda.get_device_capability(device)) if cuda else None
    f = Figures(args, {"gpu": torch.cuda.get_device_name(device) if cuda else "cpu", "gpus": torch.cuda.device_count(),
                       "capability": ".".join(map(str, capability)) if capability else None,
                       "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2 ** 30, 1)
                       if cuda else None, "default_precision": resolve("auto", device), "sync_checked": cuda,
                       "arch": args.arch, "image_size": args.image_size})
    default = f.figures["default_precision"]
    bf16 = "" if not cuda or capability >= BF16_CAPABILITY else " (no bf16 TensorCores below 8.0)"
    device_said = (f"{f.figures['gpu']} (compute capability {f.figures['capability']}, {f.figures['memory_gib']} GiB, "
                   f"{f.figures['gpus']} GPU(s) visible)" if cuda else "no GPU: the CPU at toy sizes")
    print(f"{device_said}: default precision {default}{bf16}; {args.arch} at {args.image_size} px, {args.steps} steps "
          "a run", flush=True)
    sizes = ["--arch", args.arch, "--image-size", str(args.image_size),
             *(["--batch-size", str(args.batch_size)] if args.batch_size else [])]
    try:
        run_figures(f, sizes, default, jpeg_maker)
    except OutOfTime:
        print("the check's deadline passed: the figures after this point were not measured", flush=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if jpeg_maker and jpeg_maker.poll() is None:
        jpeg_maker.kill()
    for line in summary(f.figures):
        print(line, flush=True)
    f.save()
    if args.calibration:
        args.calibration.write_text(calibration(f.figures))
    return 1 if any("failed" in r for r in f.figures["runs"]) else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (a loader's threads or reader processes left by a run cut at the deadline must not hold the exit)
