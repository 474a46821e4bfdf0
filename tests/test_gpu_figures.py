"""scripts/gpu_figures.py (the figures of scripts/gpu_check.sh) on a CPU: its sync check (a hook of the
loop), with torch.cuda's sync debug mode stood in for by one that fails a host read while it says
"error" (a CPU has no such mode), lets a run through that reads only where the host may read and stops
one whose step reads, naming the line; its count of what runs inside a trace's named range; and its
table, JSON, calibration line and kept trace from tiny runs, with DALI absent (no JPEG made)."""
import gzip
import json
import subprocess
import sys

import pytest
import torch

from helpers import REPO, child_env

sys.path.insert(0, str(REPO / "scripts"))
import gpu_figures  # noqa: E402

TINY = ["--arch", "resnet18", "--image-size", "16", "--batch-size", "4", "--log-every", "4", "--loader", "synthetic",
        "--synthetic-images", "256", "--synthetic-classes", "10", "--max-steps", "9"]


@pytest.fixture
def sync_debug_mode(monkeypatch):
    """torch.cuda.set_sync_debug_mode as the GPU has it, for the host reads a CPU can see: in "error"
    mode a read of a tensor's value raises as a synchronising CUDA call would."""
    mode = {"now": 0, "errors": 0}

    def set_mode(value):
        mode.update(now=value, errors=mode["errors"] + (value == "error"))
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", set_mode)
    original = torch.Tensor.item

    def item(self):
        if mode["now"] == "error":
            raise RuntimeError("called a synchronizing CUDA operation")
        return original(self)
    monkeypatch.setattr(torch.Tensor, "item", item)
    return mode


@pytest.mark.slow(seconds=15)
def test_the_sync_check_passes_a_clean_step_and_names_a_read_in_it(tmp_path, sync_debug_mode, monkeypatch):
    clean = gpu_figures.train(tmp_path / "clean", TINY, sync_check=True)
    assert "failed" not in clean and clean["img_per_s"] > 0 and clean["batch"] == 4, clean
    assert sync_debug_mode["errors"] >= 9 - gpu_figures.UNCHECKED_STEPS  # on in every step after the first three
    assert sync_debug_mode["now"] == 0  # left as it was found
    from train import meters
    monkeypatch.setattr(meters.LossMeter, "add", lambda self, loss: setattr(self, "total", self.total + loss.item()))
    reading = gpu_figures.train(tmp_path / "reading", TINY, sync_check=True)
    assert reading["failed"].startswith("synchronised at train/loop.py:"), reading  # (the step's loss, read)
    assert "synchronizing CUDA operation" in reading["failed"]


def test_a_named_range_counts_the_kernels_its_calls_launched_and_its_foreach_calls(tmp_path):
    """A trace as torch.profiler writes one on CUDA (Chrome trace JSON, gzipped): two "optimizer"
    ranges on the main thread; kernels count when their launch lies inside a range on that thread."""
    def event(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur, "args": args}
    events = [event("user_annotation", "optimizer", 100, 50), event("user_annotation", "optimizer", 300, 20),
              event("cpu_op", "aten::_foreach_mul_", 105, 10), event("cpu_op", "aten::_fused_sgd_", 305, 5),
              event("cpu_op", "aten::mul_", 120, 5),
              event("cuda_runtime", "cudaLaunchKernel", 106, 2, correlation=1),
              event("cuda_runtime", "cudaLaunchKernel", 108, 2, correlation=2),
              event("cuda_driver", "cuLaunchKernel", 306, 2, correlation=3),
              event("cuda_runtime", "cudaLaunchKernel", 200, 2, correlation=4),  # between the ranges
              event("cuda_runtime", "cudaLaunchKernel", 110, 2, tid=2, correlation=5),  # another thread
              *(event("kernel", f"k{c}", 1000 + c, 1, tid=9, correlation=c) for c in (1, 2, 3, 4, 5)),
              event("gpu_memcpy", "Memcpy HtoD", 1100, 1, tid=9, correlation=2)]
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as file:
        json.dump({"traceEvents": events}, file)
    assert gpu_figures.range_figures(trace, "optimizer") == {"steps": 2, "kernels_per_step": 1.5,
                                                             "calls_per_step": 1.0, "host_ms_per_step": 0.035}
    assert gpu_figures.range_figures(trace, "all-reduce") == {"steps": 0}


@pytest.mark.slow(seconds=40)
def test_the_table_json_calibration_and_trace_of_small_runs_with_dali_absent(tmp_path):
    """DALI hidden from the script (as on a node without it): its rows say `DALI absent` and no JPEG is
    made; the synthetic run, the trace run (the LARS step's calls counted from it: a CPU has no
    kernels), the kept trace, the JSON and the calibration line."""
    work, out = tmp_path / "work", tmp_path / "out"
    out.mkdir()
    argv = ["--work", work, "--json", out / "figures.json", "--trace", out / "trace.json.gz", "--calibration",
            out / "calibration.yaml", "--arch", "resnet18", "--image-size", "24", "--steps", "8", "--batch-size", "4",
            "--skip", "compile,ghost-bn,horovod"]
    hidden = ("import runpy, sys; sys.modules['nvidia.dali'] = None; sys.argv = sys.argv[1:]; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", hidden, REPO / "scripts" / "gpu_figures.py", *map(str, argv)],
                          capture_output=True, text=True, timeout=600, env=child_env(), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.splitlines()
    figures = json.loads((out / "figures.json").read_text())
    rows = {r["run"]: r for r in figures["runs"]}
    assert list(rows) == ["synthetic fp32", "synthetic fp32 --compile", "trace fp32", "dali fp32", "dali feed",
                          "2 GPUs fp32", "horovod fp32", "ghost BatchNorm"]
    assert rows["synthetic fp32"]["img_per_s"] > 0 and rows["synthetic fp32"]["batch"] == 4
    assert any(line.startswith("synthetic fp32 ") and "sync not checked (no GPU) / synthetic" in line for line in lines)
    assert [line for line in lines if line.startswith("dali")] == [f"{'dali fp32':<30} DALI absent",
                                                                  f"{'dali feed':<30} DALI absent"]
    assert not list(work.rglob("*.JPEG")) and not (work / "jpegs").exists()
    assert rows["trace fp32"]["lars_step"]["steps"] == 2 and rows["trace fp32"]["lars_step"]["calls_per_step"] > 0
    assert rows["2 GPUs fp32"]["said"] == "0 GPU(s) visible: no 2-GPU stage"
    assert figures["trace"]["of"] == "trace fp32"
    with gzip.open(out / "trace.json.gz", "rt") as trace:
        assert any(e.get("name") == "optimizer" for e in json.load(trace)["traceEvents"])
    assert figures["default_precision"] == "fp32" and figures["planner"]["measured_img_s"] > 0
    assert sum(line.startswith("published: ") for line in lines) == 2
    calibration = (out / "calibration.yaml").read_text()
    assert "per_gpu_batch: 4" in calibration and "not for calibration" in calibration  # (a CPU's figure)
