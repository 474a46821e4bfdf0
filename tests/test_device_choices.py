"""What the GPU decides when the flags leave it open, checked with the GPU faked (these machines have
none; scripts/gpu_check.sh runs the real one): the precision by compute capability (fp16 with loss
scaling below 8.0, where bf16 would be emulated; bf16 from 8.0), the loader (DALI decoding on the GPU
where DALI's CUDA build is there, else torch with a line saying why), and the per-GPU batch (the largest
multiple of 16 up to 512 that fits the GPU's memory, by the memory model, models/memory.py)."""
import functools
import socket
from types import SimpleNamespace

import pytest
import torch

from helpers import resnet50_kept_values, run_train
from train.device_choices import check_kernels, choose_loader, default_batch, has_kernels_for, loader_summary
from train.errors import UsageError
from train.precision import explain, resolve

GPU = torch.device("cuda", 0)
CPU = torch.device("cpu")
RESNET50_PARAMETERS = 25_557_032  # torchvision's ResNet-50


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of a given compute capability and memory, as torch.cuda would describe it."""
    def make(capability, name="Tesla V100-SXM2-16GB", memory_gib=16):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device=None: SimpleNamespace(total_memory=memory_gib * 2 ** 30, name=name))
        # what torch says of bf16 on every one of them, V100 included (it counts emulation): not the rule
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True)
    return make


@pytest.mark.parametrize("capability, name, expected", [
    ((7, 0), "Tesla V100-SXM2-16GB", "fp16"), ((7, 5), "Tesla T4", "fp16"),
    ((8, 0), "NVIDIA A100-SXM4-80GB", "bf16"), ((9, 0), "NVIDIA H100 80GB HBM3", "bf16")])
def test_auto_precision_follows_the_compute_capability(fake_gpu, capability, name, expected):
    fake_gpu(capability, name)
    assert resolve("auto", GPU) == expected
    source, warning = explain("auto", GPU)
    major, minor = capability
    assert source.startswith(f"{expected} on {name} (compute capability {major}.{minor}") and not warning
    assert ("below 8.0" in source) == (expected == "fp16") and ("from 8.0 up" in source) == (expected == "bf16")


def test_bf16_below_8_0_runs_with_a_warning_and_fp16_or_fp32_as_asked(fake_gpu):
    fake_gpu((7, 0))
    assert resolve("bf16", GPU) == "bf16"
    source, warning = explain("bf16", GPU)
    assert "as asked" in source and "emulated" in warning and "compute capability 7.0" in warning
    assert "\n" not in warning
    assert explain("fp32", GPU)[1] == explain("fp16", GPU)[1] == ""
    fake_gpu((8, 6), "NVIDIA A40")
    assert explain("bf16", GPU)[1] == ""  # TensorCores there: nothing to say


def test_on_a_cpu_auto_is_fp32_and_fp16_is_refused():
    assert resolve("auto", CPU) == "fp32" and explain("auto", CPU) == ("fp32 on cpu", "")
    with pytest.raises(UsageError, match="fp16 needs a CUDA GPU"):
        resolve("fp16", CPU)


def test_the_loader_is_dali_decoding_on_the_gpu_where_it_can():
    with_dali, without = (lambda: ""), (lambda: "DALI is not installed (pip install nvidia-dali-cuda130)")
    assert choose_loader("auto", "auto", GPU, with_dali) == ("dali", "")
    loader, warning = choose_loader("auto", "auto", GPU, without)
    assert loader == "torch" and "DALI is not installed" in warning and "\n" not in warning
    assert choose_loader("auto", "auto", CPU, with_dali) == ("torch", "")
    assert choose_loader("torch", "auto", GPU, with_dali) == ("torch", "")  # asked for: kept, nothing said
    assert choose_loader("dali", "cpu", GPU, with_dali) == ("dali", "")
    with pytest.raises(UsageError, match="--dali-decode gpu needs a CUDA GPU"):
        choose_loader("dali", "gpu", CPU, with_dali)


def test_the_header_names_the_loader_in_its_own_words():
    assert loader_summary("torch", "auto", 2, CPU) == "torch, 2 threads"
    assert loader_summary("dali", "auto", 2, CPU) == "dali, decode on CPU, 2 threads"
    assert loader_summary("dali", "auto", 4, GPU) == "dali, decode on GPU"
    assert loader_summary("dali", "cpu", 1, GPU) == "dali, decode on CPU, 1 thread"
    assert loader_summary("synthetic", "auto", 4, GPU) == "synthetic"


@functools.lru_cache(maxsize=None)
def kept_bytes_per_image(precision: str) -> float:
    """What backward keeps of one 224 px image, counted here on ResNet-50 (docs/planner.md, Memory): 2 bytes
    a value in fp16 and bf16, 4 in fp32."""
    return resnet50_kept_values() * (4 if precision == "fp32" else 2)


def step_fits(batch: int, memory_bytes: float, precision: str) -> bool:
    """The memory model's sum (docs/planner.md): activations, 16 bytes per parameter, a 2 GB reserve."""
    return batch * kept_bytes_per_image(precision) + 16 * RESNET50_PARAMETERS + 2e9 <= memory_bytes


@pytest.mark.parametrize("capability, name, memory_gib, precision, expected", [
    ((7, 0), "Tesla V100-SXM2-16GB", 16, "fp16", 256), ((7, 0), "Tesla V100-SXM2-16GB", 16, "fp32", 128),
    ((8, 0), "NVIDIA A100-SXM4-40GB", 40, "bf16", 512), ((8, 0), "NVIDIA A100-SXM4-40GB", 40, "fp16", 512),
    ((8, 0), "NVIDIA A100-SXM4-80GB", 80, "bf16", 512), ((9, 0), "NVIDIA H100 80GB HBM3", 80, "bf16", 512),
    ((9, 0), "NVIDIA H200", 141, "bf16", 512), ((8, 6), "a GPU of 8 GiB", 8, "fp16", 96)])
def test_the_per_gpu_batch_is_the_largest_multiple_of_16_up_to_512_that_fits(fake_gpu, capability, name, memory_gib,
                                                                              precision, expected):
    """At 224 px: the batch fits 85% of the GPU's memory by the model's own per-image figure, counted
    here, and 16 more would not (or it is 512, the most the rule takes)."""
    fake_gpu(capability, name, memory_gib)
    usable = 0.85 * memory_gib * 2 ** 30
    batch, note = default_batch(GPU, precision, 224, "resnet50")
    assert batch == expected and batch % 16 == 0
    assert step_fits(batch, usable, precision) and (batch == 512 or not step_fits(batch + 16, usable, precision))
    assert note == (f"batch {expected} per GPU: the largest multiple of 16 up to 512 whose {precision} step fits 85% "
                    f"of its {memory_gib} GiB")


def test_the_per_gpu_batch_follows_the_crop_and_stays_256_on_a_cpu(fake_gpu):
    fake_gpu((7, 0))  # 16 GiB
    assert default_batch(GPU, "fp16", 112, "resnet50")[0] == 512  # a quarter of the pixels: 4 x 269 fit, 512 at most
    assert default_batch(GPU, "fp16", 448, "resnet50")[0] == 64  # four times the pixels: 67 fit
    assert default_batch(CPU, "fp32", 224, "resnet50") == (256, "")
    fake_gpu((7, 0), memory_gib=2)  # not even 16 images beside the 2 GB reserve
    with pytest.raises(UsageError, match="not 16 images of 224 px fit 85% of its 2 GiB"):
        default_batch(GPU, "fp16", 224, "resnet50")


def test_dali_decoding_on_the_gpu_without_one_is_one_line(tmp_path):
    done = run_train("--loader", "dali", "--dali-decode", "gpu", "--max-steps", 1, "--out-dir", "run", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --dali-decode gpu needs a CUDA GPU; use --dali-decode cpu (or auto) here"
    assert not (tmp_path / "run").exists()


# what torch.cuda.get_arch_list() says in torch 2.14's builds: CUDA 13 (PyPI's default) and CUDA 12.6 (PyTorch's index)
CUDA13_BUILD = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]
CUDA126_BUILD = ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90"]


@pytest.mark.parametrize("capability, arch_list, runs", [
    ((7, 0), CUDA13_BUILD, False),  # V100: CUDA 13 dropped Volta
    ((7, 0), CUDA126_BUILD, True),
    ((7, 5), CUDA13_BUILD, True), ((8, 0), CUDA13_BUILD, True), ((9, 0), CUDA13_BUILD, True),
    ((8, 9), CUDA13_BUILD, True),  # L4, L40S: sm_86's machine code runs on 8.9
    ((10, 3), CUDA13_BUILD, True),  # sm_100's on 10.3
    ((11, 0), CUDA13_BUILD, False),  # another major version: no machine code of its own, no PTX
    ((10, 0), CUDA126_BUILD, False),
    ((8, 0), ["sm_86"], False),  # machine code runs at its minor or above, not below
    ((12, 0), ["sm_80", "compute_80"], True),  # PTX: compiled by the driver for newer GPUs
    ((7, 0), ["compute_80"], False),  # but not for older ones
    ((9, 0), ["sm_90a"], True), ((10, 0), ["sm_100a"], True), ((10, 3), ["sm_100a"], False),  # `a`: its own alone
    ((7, 0), [], True),  # a build that does not say: not refused
])
def test_a_gpu_has_kernels_when_machine_code_of_its_major_or_ptx_below_it_is_built(capability, arch_list, runs):
    assert has_kernels_for(capability, arch_list) is runs


@pytest.fixture
def torch_build(monkeypatch):
    """The installed torch as built for these architectures, on a machine whose first GPU is faked."""
    def make(arch_list):
        monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: list(arch_list))
        monkeypatch.setattr(torch.version, "hip", None)
    return make


def test_a_gpu_the_torch_build_has_no_kernels_for_is_refused_in_one_line(fake_gpu, torch_build):
    fake_gpu((7, 0), "Tesla V100-SXM2-32GB")
    torch_build(CUDA13_BUILD)
    with pytest.raises(UsageError) as refused:
        check_kernels(GPU)
    line = str(refused.value)
    assert line.startswith(f"Tesla V100-SXM2-32GB (compute capability 7.0, GPU 0 of {socket.gethostname()}): "
                           f"torch {torch.__version__} has no kernels for it (built for sm_75, sm_80, sm_86, sm_90, "
                           "sm_100, sm_120); run scripts/setup.sh on this node")
    assert "CUDA 12.6" in line and "Dockerfile" in line and "\n" not in line
    torch_build(CUDA126_BUILD)
    check_kernels(GPU)  # the build setup.sh installs for it
    fake_gpu((9, 0), "NVIDIA H100 80GB HBM3")
    torch_build(CUDA13_BUILD)
    check_kernels(GPU)


def test_the_cpu_is_not_asked_about_kernels(monkeypatch):
    def no_gpu_here(*args):
        raise AssertionError("torch.cuda asked on a CPU run")
    monkeypatch.setattr(torch.cuda, "get_arch_list", no_gpu_here)
    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu_here)
    check_kernels(CPU)


@pytest.fixture
def visible_v100_under_cuda13(fake_gpu, torch_build, monkeypatch):
    """One V100 visible to a CUDA 13 build of torch (which has no kernels for it), on a CPU machine."""
    fake_gpu((7, 0), "Tesla V100-SXM2-16GB")
    torch_build(CUDA13_BUILD)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def test_a_run_on_a_gpu_without_kernels_ends_at_start_with_exit_2(visible_v100_under_cuda13, tmp_path, capsys):
    """Where every engine takes its device (train/engines/launch.py, local_device): one line, exit 2,
    before the run directory exists or any kernel runs (a CPU machine, its one V100 faked)."""
    from train.__main__ import main
    code = main(["--arch", "resnet18", "--loader", "synthetic", "--synthetic-images", "64", "--image-size", "32",
                 "--max-steps", "1", "--out-dir", str(tmp_path / "run")])
    printed = capsys.readouterr()
    assert code == 2, printed
    assert printed.err.startswith("error: Tesla V100-SXM2-16GB (compute capability 7.0, GPU 0 of ")
    assert len(printed.err.strip().splitlines()) == 1 and not printed.out
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command", ["predict", "bench infer"])
def test_predict_and_bench_infer_refuse_a_gpu_without_kernels_alike(command, visible_v100_under_cuda13, tmp_path, capsys):
    """predict and bench infer take their GPU where training does, checked the same way."""
    (tmp_path / "photo.jpg").write_bytes(b"not read before the device is chosen")
    if command == "predict":
        from train.predict import main
        code = main([str(tmp_path / "run"), str(tmp_path / "photo.jpg")])
    else:
        from train.bench import main
        code = main(["infer", "--arch", "resnet18", "--report", str(tmp_path / "infer.json")])
    printed = capsys.readouterr()
    assert code == 2, printed
    assert printed.err.startswith("error: Tesla V100-SXM2-16GB (compute capability 7.0, GPU 0 of "), printed.err
    assert len(printed.err.strip().splitlines()) == 1 and not (tmp_path / "infer.json").exists()
