"""Every transfer to the device in the step path goes through `data.transfer.to_device` (docs/gpu.md,
"Transfers"): a blocking host-to-device copy synchronises the GPU as `.item()` does, and a CPU cannot
see the wait, so the transfers themselves are checked.

- At run time, on the training thread of short `python -m train` runs (the synthetic, torch and DALI
  loaders, evaluation with --eval-flip, --bn-recompute-batches): tests/helpers/transfers.py counts
  every transfer outside to_device by the trainer's line; only the start-up and epoch-end code of
  ALLOWED may make one.
- Statically, over the step path's modules: the branches only a GPU runs (the torch loader's pinned
  uint8 batch, DALI's labels) are read, not run, for calls with a device argument outside to_device.
"""
import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import REPO, child_env
from helpers.transfers import counting_transfers
from data.transfer import to_device

# (module, function) -> why it may move host data to the device without to_device
ALLOWED = {
    ("train/loop.py", "Training.__init__"): "start-up: the model's weights reach the device once, before the first step",
    ("train/ema.py", "WeightAverage.__init__"): "start-up: --ema-decay's copy of the model reaches the device once",
    ("train/evaluate.py", "test_only"): "start-up of --test-only: the checkpoint's model reaches the device once",
}

# the modules the step runs: the loaders and their batches, the model, the loop, the optimizer step and
# the engines, evaluation and the BatchNorm statistics
STEP_PATH = sorted({*(REPO / "data").glob("*.py"), *(REPO / "models").glob("*.py"), *(REPO / "train" / "engines").glob("*.py"),
                    *(REPO / "train" / name for name in ("loop.py", "evaluate.py", "bnstats.py", "lars.py", "optim.py",
                                                          "precision.py", "ema.py", "meters.py", "schedule.py"))}
                   - {REPO / "data" / "transfer.py"})
HOST_DATA = {"tensor", "as_tensor", "asarray", "from_numpy"}


# the static check ---------------------------------------------------------------------------------
def static_transfers(source: str) -> list[tuple[int, str, str]]:
    """(line, function, call) of each call in `source` that moves host data to a device: `.to(...)` or
    `.cuda()` given a device (a keyword `device`, a string, a name or attribute that says `device`, or
    `torch.device(...)`), `.new_tensor(...)` (its tensor's device), `torch.tensor`/`as_tensor`/`asarray`
    with a device argument, and `copy_` from one of those made on the host. A dtype or memory format
    passed to `.to` is not a device (`.to(dtype)`, `.to(x.dtype)`)."""
    found = []

    class Visitor(ast.NodeVisitor):
        def __init__(self):
            self.names = []

        def scoped(self, node):
            self.names.append(node.name)
            self.generic_visit(node)
            self.names.pop()
        visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = scoped

        def visit_Call(self, node):
            kind = _transfer_kind(node)
            if kind:
                found.append((node.lineno, ".".join(self.names) or "<module>", kind))
            self.generic_visit(node)

    Visitor().visit(ast.parse(source))
    return found


def _transfer_kind(call: ast.Call) -> str | None:
    func = call.func
    if not isinstance(func, ast.Attribute):
        return None
    keywords = {k.arg for k in call.keywords}
    torch_function = isinstance(func.value, ast.Name) and func.value.id == "torch"
    if func.attr == "to" and not torch_function and ("device" in keywords or any(map(_says_device, call.args))):
        return "to"
    if func.attr in ("cuda", "new_tensor") and not torch_function:
        return func.attr
    if torch_function and func.attr in HOST_DATA - {"from_numpy"} and "device" in keywords:
        return func.attr
    if func.attr in ("copy_", "_foreach_copy_") and any(_made_on_host(a) for a in call.args):
        return func.attr
    return None


def _says_device(node: ast.expr) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.Name):
        return "device" in node.id
    if isinstance(node, ast.Attribute):
        return "device" in node.attr
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "device"


def _made_on_host(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in HOST_DATA


def test_the_static_check_finds_every_kind_of_transfer():
    """The check itself, on a module written here: each kind of transfer found, with its function;
    dtype changes and the factories that compute on the device are not transfers."""
    source = '''
import torch
def batch(x, labels, device, array):
    a = x.to(device=device, dtype=torch.int64)
    b = labels.pin_memory().to(self.device, non_blocking=True)
    c = torch.tensor([1, 2], device=x.device)
    d = x.new_tensor([3])
    e = x.cuda()
    x.copy_(torch.from_numpy(array))
    f = x.to("cuda")
    g = torch.as_tensor(array, device=torch.device("cuda"))
    h = x.to(device)
    return x.to(torch.float16), x.to(x.dtype), x.to(dtype), torch.zeros(2, device=device), torch.arange(4, device=device)
class Maker:
    def move(self, v):
        return v.to(self.device)
'''
    assert static_transfers(source) == [(4, "batch", "to"), (5, "batch", "to"), (6, "batch", "tensor"),
                                        (7, "batch", "new_tensor"), (8, "batch", "cuda"), (9, "batch", "copy_"),
                                        (10, "batch", "to"), (11, "batch", "as_tensor"), (12, "batch", "to"),
                                        (16, "Maker.move", "to")]


def test_no_step_path_module_moves_host_data_to_the_device_but_through_to_device():
    assert len(STEP_PATH) > 20  # (the globs found the modules)
    found = []
    for path in STEP_PATH:
        module = str(path.relative_to(REPO))
        for line, function, kind in static_transfers(path.read_text()):
            if (module, function) not in ALLOWED:
                found.append(f"{module}:{line} {function} ({kind})")
    assert not found, "transfers to the device outside data/transfer.py's to_device: " + ", ".join(found)


# the run-time check --------------------------------------------------------------------------------
def test_the_counter_counts_transfers_outside_to_device_only(monkeypatch):
    """The counter itself: each kind of transfer made here (this file stands in for the trainer's code,
    so the counter is told to take tests/ as ours) counted once, to_device's none."""
    import helpers.transfers as counter
    host, methods = torch.arange(4), (torch.Tensor.to, torch.Tensor.copy_, torch.tensor)
    monkeypatch.setattr(counter, "OURS", (str(REPO / "tests") + "/",))
    with counting_transfers() as counts:
        host.to("cpu")
        host.to(torch.device("cpu"), non_blocking=True)
        host.to(torch.float64)  # a dtype: not a transfer
        torch.tensor([1, 2], device="cpu")
        torch.as_tensor([1, 2])  # on the host: not a transfer
        host.new_tensor([5])
        torch.empty(4, dtype=torch.int64).copy_(torch.as_tensor([1, 2, 3, 4]))  # from host data
        torch.empty(4, dtype=torch.int64).copy_(host * 2)  # from a tensor computed where it lives: not one
        torch.empty(4, dtype=torch.int64)[:2] = torch.as_tensor([1, 2])  # an assignment from host data
        torch.empty(4, dtype=torch.int64)[:2] = host[:2]  # not one
        to_device(host, torch.device("cpu"))
    kinds = sorted(where.rsplit(" ", 1)[1] for where, n in counts.items() for _ in range(n))
    assert kinds == ["(__setitem__)", "(copy_)", "(new_tensor)", "(tensor)", "(to)", "(to)"], counts
    assert (torch.Tensor.to, torch.Tensor.copy_, torch.tensor) == methods  # (torch as it was after the block)


SHORT = ["--arch", "resnet18", "--image-size", 16, "--batch-size", 4, "--log-every", 1000, "--epochs", 1,
         "--max-steps", 3, "--eval-flip", "--bn-recompute-batches", 2]
SYNTHETIC = ["--loader", "synthetic", "--synthetic-images", 64, "--synthetic-val-images", 10, "--synthetic-classes", 10]


def counted_transfers(tmp_path, flags) -> dict:
    out = tmp_path / "transfers.json"
    done = subprocess.run([sys.executable, str(REPO / "tests" / "helpers" / "transfers.py"), out,
                           *map(str, ["--out-dir", tmp_path / "run", *SHORT, *flags])],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, env=child_env())
    assert done.returncode == 0 and json.loads(out.read_text())["exit"] == 0, done.stdout + done.stderr
    assert "eval " in done.stdout, done.stdout  # (the run evaluated: that path was counted too)
    return json.loads(out.read_text())["transfers"]


@pytest.fixture(scope="module")
def small_tree(tmp_path_factory) -> Path:
    import data.embedded as embedded
    return embedded.ensure_embedded(train_per_class=2, val_per_class=1, root=tmp_path_factory.mktemp("tree"))


@pytest.mark.slow(seconds=15)
@pytest.mark.parametrize("loader", ["synthetic", "torch", "dali"])
def test_a_run_moves_host_data_to_the_device_only_through_to_device(tmp_path, loader, request):
    """Training steps, the evaluation (with flips) and the BatchNorm recomputation of a short run."""
    if loader == "dali":
        pytest.importorskip("nvidia.dali", reason="DALI is not installed")
    flags = SYNTHETIC if loader == "synthetic" else \
        ["--loader", loader, "--workers", 1, "--data-dir", request.getfixturevalue("small_tree")]
    counts = counted_transfers(tmp_path, flags)
    assert any(where.startswith("train/loop.py") for where in counts), \
        f"the model's move to the device at start-up was not counted: the counter is not counting ({counts})"
    outside = {where: n for where, n in counts.items()
               if (where.split(":")[0], where.split(" ")[1]) not in ALLOWED}
    assert not outside, f"transfers to the device outside to_device ({loader}): " + \
        ", ".join(f"{where}: {n}" for where, n in outside.items())


# to_device on a GPU --------------------------------------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_to_device_queues_the_copy_without_waiting_for_the_gpu():
    device = torch.device("cuda")
    pageable, pinned = torch.arange(1 << 20), torch.arange(1 << 20).pin_memory()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        moved = [to_device(t, device) for t in (pageable, pinned)]
        on_device = to_device(moved[0], device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert on_device is moved[0] and all(m.device.type == "cuda" for m in moved)
    assert all(torch.equal(m.cpu(), pageable) for m in moved)


@pytest.mark.gpu
@needs_cuda
def test_synthetic_batches_never_synchronise_the_gpu():
    from data.loaders import SyntheticLoader
    from train.config import Config
    cfg = Config(loader="synthetic", image_size=64, batch_size=32, synthetic_images=256, synthetic_val_images=40)
    loader = SyntheticLoader(cfg, 0, 1, torch.device("cuda"))  # (its banks reach the GPU here, at start-up)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronising call raises
    try:
        batches = [batch for _, batch in zip(range(4), loader.train_batches(0))] + list(loader.val_batches())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [tuple(x.shape) for x, _ in batches] == [(32, 3, 64, 64)] * 5 + [(8, 3, 64, 64)]
    assert all(x.is_cuda and y.is_cuda and x.is_contiguous(memory_format=torch.channels_last) for x, y in batches)
