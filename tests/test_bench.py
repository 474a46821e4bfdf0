"""`python -m train.bench` (train/bench.py; docs/bench.md): the trainer's own step timed (data wait
against compute, over ranks), inference timed per batch size and backend, and the two training flags
the train mode reuses: --no-checkpoints and --synthetic-val-images 0. Tiny runs: resnet18 at 32 px.

No test asserts an absolute speed: the slow-input tests compare runs of the same step, one fed from
memory (synthetic batches) and one from a real slow input: a --workers 1 torch loader decoding whole
1536-px JPEGs of noise (--crop-min-scale 1: no smaller region to decode), which the step waits for;
or one decoding 2400x1800 photos-like JPEGs on two threads while the step computes on both cores,
which keeps up (no wait) but slows the step, and only the step timed again with the loader idle shows
it."""
import gzip
import json

import numpy as np
import pytest
from PIL import Image

from helpers import launch, read_metrics, run_module, run_train
from train.bench import TRAIN_KEYS

TINY = ["--arch", "resnet18", "--image-size", 32, "--threads", 1]
BATCH = 16  # the slow input's whole training set is one global batch: decoding dominates its step


def bench(*args, cwd, **kwargs):
    return run_module("train.bench", *args, cwd=cwd, **kwargs)


def train_report(tmp_path, name: str, *flags, steps=4) -> dict:
    report = tmp_path / f"{name}.json"
    done = bench("train", *TINY, "--batch-size", BATCH, "--warmup-steps", 1, "--steps", steps, "--report", report,
                 *flags, cwd=tmp_path)  # (flags given later win: --threads, --warmup-steps)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "data wait" in done.stdout and "compute" in done.stdout, done.stdout
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict:
    """The default benchmark: the trainer's step on synthetic batches."""
    return train_report(tmp_path_factory.mktemp("synthetic"), "synthetic")


def jpeg_tree(root, per_class: int, picture, quality: int) -> None:
    """Two classes of JPEGs, `per_class` to train on and 1 to evaluate each, `picture(rng)` each."""
    rng = np.random.default_rng(0)
    for split, count in (("train", per_class), ("val", 1)):
        for name in ("a", "b"):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                picture(rng).save(folder / f"{i}.JPEG", quality=quality)


def big_jpegs(root, size=1536, per_class=8) -> None:
    """Noise JPEGs (about 3 MB each: slow to decode, whatever the crop)."""
    jpeg_tree(root, per_class, lambda rng: Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)), 95)


@pytest.mark.slow(seconds=20)
def test_the_train_report_has_exactly_its_keys(synthetic):
    assert set(synthetic) == set(TRAIN_KEYS)
    assert synthetic["steps"] == 4 and synthetic["ranks"] == 1
    assert synthetic["images_per_s"] == synthetic["images_per_s_per_rank"] > 0
    assert 0 <= synthetic["data_wait_ms_p50"] <= synthetic["data_wait_ms_p95"]
    assert 0 < synthetic["compute_ms_p50"] <= synthetic["compute_ms_p95"]
    assert synthetic["compute_alone_ms_p50"] > 0 and synthetic["input_cost_ms_p50"] >= 0


STEP_RANGES = ["data wait", "forward", "backward", "optimizer"]  # one process: no all-reduce to wait for


@pytest.mark.slow(seconds=15)
def test_profile_writes_a_gzipped_chrome_trace_of_measured_steps_with_the_named_ranges(tmp_path):
    """--profile: rank 0's trace-rank0.json.gz, Chrome trace JSON (what Perfetto and TensorBoard's
    trace viewer open), holding the first measured steps but not the last (the step alone is timed
    after it), each step's named ranges inside its step, in the order the step runs them."""
    train_report(tmp_path, "profiled", "--profile", tmp_path / "traces", steps=3)
    assert sorted(p.name for p in (tmp_path / "traces").iterdir()) == ["trace-rank0.json.gz"]
    with gzip.open(tmp_path / "traces" / "trace-rank0.json.gz", "rt") as trace:
        events = [e for e in json.load(trace)["traceEvents"] if e.get("ph") == "X"]
    steps = sorted((e for e in events if e["name"].startswith("ProfilerStep#")), key=lambda e: e["ts"])
    assert len(steps) == 2, [e["name"] for e in steps]  # measured steps 1 and 2 of 3
    named = [e for e in events if e["cat"] == "user_annotation" and e["name"] in (*STEP_RANGES, "all-reduce")]
    for step in steps:
        inside = sorted((e for e in named if step["ts"] <= e["ts"] and e["ts"] + e["dur"] <= step["ts"] + step["dur"]),
                        key=lambda e: e["ts"])
        assert [e["name"] for e in inside] == STEP_RANGES, [e["name"] for e in inside]
    assert len(named) == 2 * len(STEP_RANGES)  # (none outside the profiled steps)


def test_the_profile_holds_the_first_measured_steps_but_not_the_last(tmp_path):
    """ProfileTrace (train/bench_hooks.py) told of each step as the loop tells it, each step here a named
    range: 2 warm-up and 3 measured steps keep measured steps 1 and 2 (after the last, the step alone
    is timed), the warm-up steps dropped."""
    from types import SimpleNamespace

    import torch
    from train.bench_hooks import ProfileTrace
    trace = ProfileTrace(tmp_path, warmup_steps=2, steps=3)
    trace.run_started(SimpleNamespace(engine=SimpleNamespace(rank=0, device=torch.device("cpu"))))
    for step in range(1, 6):
        with torch.profiler.record_function(f"step {step}"):
            torch.ones(4).add_(1)
        trace.step_done(step, None)
    trace.close()
    assert trace.written == tmp_path / "trace-rank0.json.gz"
    with gzip.open(trace.written, "rt") as file:
        names = {e["name"] for e in json.load(file)["traceEvents"] if e.get("cat") == "user_annotation"}
    assert sorted(name for name in names if name.startswith("step ")) == ["step 3", "step 4"]


@pytest.mark.slow(seconds=40)
def test_data_wait_rises_when_the_input_is_slow(synthetic, tmp_path):
    big_jpegs(tmp_path / "big")
    slow = train_report(tmp_path, "slow", "--data-dir", tmp_path / "big", "--loader", "torch", "--workers", 1,
                        "--crop-min-scale", 1, steps=3)
    assert slow["data_wait_ms_p50"] > 5 * synthetic["data_wait_ms_p50"], (slow, synthetic)
    assert slow["input_bound"], (slow, synthetic)


def smooth_jpegs(root, per_class=32) -> None:
    """2400x1800 JPEGs of smooth colour fields (as photos compress): a core decodes one, at the reduced
    scale a small crop allows, in a few milliseconds."""
    jpeg_tree(root, per_class, lambda rng: Image.fromarray(rng.integers(0, 256, (75, 100, 3), dtype=np.uint8))
              .resize((2400, 1800), Image.BICUBIC), 90)


@pytest.mark.slow(seconds=40)
@pytest.mark.alone  # (the step timed with and without the loader's threads: another test's load would blur it)
def test_a_loader_that_keeps_up_but_takes_the_cores_is_input_bound(tmp_path):
    """Two loader threads decoding while the step computes on both cores: its batches are ready in time
    (the wait stays near zero), but the step is slower than the same step with the loader idle, and
    that difference is the input's cost. (Two threads on large pictures cost about half the step when
    the test runs by itself; one thread on 1600x1200 ones cost a third, which the full suite's runs hid
    twice: their quiet steps came out slower.)"""
    smooth_jpegs(tmp_path / "photos")
    both_cores = ["--threads", 2, "--warmup-steps", 2, "--epochs", 8]
    quiet = train_report(tmp_path, "quiet", *both_cores, steps=8)
    tries = []  # a second try where the first was not input bound: another process's burst of work during
    for attempt in range(2):  # the quiet steps reads as compute
        busy = train_report(tmp_path, f"busy{attempt}", *both_cores, "--data-dir", tmp_path / "photos",
                            "--loader", "torch", "--workers", 2, steps=8)
        tries.append(busy)
        if busy["input_bound"]:
            break
    def share(report):  # of the median step, what the input costs it
        return report["input_cost_ms_p50"] / (report["data_wait_ms_p50"] + report["compute_ms_p50"])
    assert busy["input_bound"], json.dumps(tries)
    assert share(busy) > share(quiet) + 0.05, (busy, quiet)  # (synthetic batches cost a little too: their making)
    assert busy["compute_alone_ms_p50"] < busy["compute_ms_p50"], busy  # the cores taken: a slower compute
    assert busy["input_cost_ms_p50"] > busy["data_wait_ms_p50"], busy  # more than the wait says


@pytest.mark.slow(seconds=40)
@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", ["torch", "horovod"])
def test_two_ranks_give_one_report_over_both(tmp_path, launcher):
    if launcher == "horovod":
        pytest.importorskip("horovod.torch")
    report = tmp_path / "two.json"
    done = launch(launcher, 2, "-m", "train.bench", "train", *TINY, "--batch-size", 2, "--warmup-steps", 1, "--steps", 3,
                  "--report", report, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    figures = json.loads(report.read_text())
    assert set(figures) == set(TRAIN_KEYS)
    assert figures["ranks"] == 2 and figures["steps"] == 3
    assert figures["images_per_s"] == pytest.approx(2 * figures["images_per_s_per_rank"], rel=0.01)
    assert done.stdout.count("benchmark:") == 1, done.stdout  # rank 0 alone says it


@pytest.mark.slow(seconds=90)
def test_infer_times_eager_and_compile_per_batch_size(tmp_path):
    report = tmp_path / "out" / "infer.json"
    done = bench("infer", "--arch", "resnet18", "--image-size", 32, "--batch-sizes", "1,4", "--backends", "eager,compile",
                 "--warmup-iterations", 2, "--iterations", 8, "--threads", 1, "--report", report, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(report.read_text())["results"]
    assert [(r["backend"], r["batch_size"]) for r in results] == [("eager", 1), ("eager", 4), ("compile", 1), ("compile", 4)]
    for row in results:
        assert set(row) == {"backend", "batch_size", "latency_ms_p50", "latency_ms_p90", "latency_ms_p95",
                            "latency_ms_p99", "images_per_s"}
        assert 0 < row["latency_ms_p50"] <= row["latency_ms_p90"] <= row["latency_ms_p95"] <= row["latency_ms_p99"], row
        assert row["images_per_s"] > 0
    assert report.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow(seconds=40)
def test_infer_reads_a_run_and_times_onnxruntime(tmp_path):
    """A run's checkpoint (its image size and precision) on eager and onnxruntime (train.export's ONNX file)."""
    pytest.importorskip("onnxruntime")
    trained = run_train(*SHORT_RUN, "--synthetic-val-images", 0, "--epochs", 1, "--out-dir", tmp_path / "run", cwd=tmp_path)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    report = tmp_path / "infer.json"
    done = bench("infer", tmp_path / "run", "--batch-sizes", "1,2", "--backends", "eager,onnxruntime",
                 "--warmup-iterations", 1, "--iterations", 5, "--threads", 1, "--report", report, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resnet18 from" in done.stdout and "at 32 px, one pass per batch (as the run's evaluation), fp32" in \
        done.stdout, done.stdout
    results = json.loads(report.read_text())["results"]
    assert [(r["backend"], r["batch_size"]) for r in results] == [("eager", 1), ("eager", 2), ("onnxruntime", 1),
                                                                   ("onnxruntime", 2)]
    assert all(r["latency_ms_p50"] <= r["latency_ms_p99"] for r in results)


SHORT_RUN = ["--loader", "synthetic", "--synthetic-images", 32, "--synthetic-classes", 4, *TINY, "--batch-size", 4,
             "--epochs", 2, "--eval-every", 1]


@pytest.mark.slow(seconds=20)
def test_no_checkpoints_writes_none_and_a_restart_starts_again(tmp_path):
    run = tmp_path / "run"
    flags = [*SHORT_RUN, "--synthetic-val-images", 8, "--no-checkpoints", "--out-dir", run]
    done = run_train(*flags, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not list(run.glob("*.pt")) and not list(run.glob(".*.tmp")), sorted(p.name for p in run.iterdir())
    assert [r["kind"] for r in read_metrics(run)].count("eval") == 2  # (the logs are written)
    again = run_train(*flags, cwd=tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "starting it again from step 0" in again.stdout, again.stdout
    assert not list(run.glob("*.pt"))
    refused = run_train(*flags, "--keep-checkpoints", 2, cwd=tmp_path)
    assert refused.returncode == 2 and "--no-save-checkpoints" in refused.stderr, refused.stderr


@pytest.mark.slow(seconds=15)
def test_no_validation_images_runs_with_no_evaluation(tmp_path):
    run = tmp_path / "run"
    done = run_train(*SHORT_RUN, "--synthetic-val-images", 0, "--out-dir", run, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    kinds = [r["kind"] for r in read_metrics(run)]
    assert kinds.count("epoch") == 2 and "eval" not in kinds, kinds
    assert "top-1" not in done.stdout and (run / "checkpoint.pt").is_file()


INFER_TINY = ["--arch", "resnet18", "--image-size", "32", "--batch-sizes", "1", "--iterations", "1", "--report", "tiny.json"]


@pytest.mark.parametrize("args, said", [
    (["infer", "--backends", "eager,tensorrt", *INFER_TINY], "unknown backend tensorrt"),
    (["infer", "--batch-sizes", "0,8"], "--batch-sizes '0,8': a batch size must be at least 1"),
    (["infer", "--image-size", "100000"], "--image-size: 100000 is not a size from 16 to 1024 px"),
    (["infer", "NOT_A_CHECKPOINT"], "NOT_A_CHECKPOINT"),
    (["infer", "NOT_A_CHECKPOINT", "--arch", "resnet50"], "--arch is for an untrained model; NOT_A_CHECKPOINT brings "
                                                         "its run's own: drop --arch"),
    (["train", "--steps", "0"], "--steps: 0 must be at least 1"),
    (["train", "--max-steps", "9"], "--max-steps is the benchmark's to set"),
    (["train", "--steps", "1", "--profile", "traces"], "--profile traces measured steps before the last one: give "
                                                       "--steps 2 or more, not 1"),
    (["fly"], "give a mode"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, args, said):
    (tmp_path / "NOT_A_CHECKPOINT").write_text("these are not weights\n")
    done = bench(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1 and said in done.stderr, done.stderr
