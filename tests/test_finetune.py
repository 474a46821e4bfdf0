"""--init-from as users of torchvision's and timm's scripts expect: ImageNet weights fine-tuned on
another class count (a new head, said in one line), and other scripts' checkpoints (weights nested
under `state_dict`, `model`, ..., names behind DDP's `module.` or torch.compile's `_orig_mod.`),
all read as plain data only."""
import argparse
import pathlib

import pytest
import torch
import torchvision

from helpers import run_train
from train.config import Config
from train.errors import UsageError
from train.startup import init_weights

RUN = ["--loader", "synthetic", "--arch", "resnet18", "--image-size", 16, "--synthetic-images", 32,
       "--synthetic-val-images", 16, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 1,
       "--eval-every", 0, "--max-steps", 1]
# a step that barely moves the weights (plain SGD, a tiny LR): they show where the run started
STILL = ["--optimizer", "sgd", "--lr", 1e-12, "--momentum", 0, "--weight-decay", 0]


def resnet18_weights(classes: int) -> dict:
    torch.manual_seed(5)
    return torchvision.models.resnet18(num_classes=classes).state_dict()


def prefixed(prefix: str, weights: dict) -> dict:
    return {prefix + name: tensor for name, tensor in weights.items()}


def start_of(tmp_path, name, *flags):
    result = run_train("--out-dir", name, *RUN, *STILL, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return result, torch.load(tmp_path / name / "checkpoint.pt", weights_only=True)["model"]


@pytest.mark.slow
def test_imagenet_weights_fine_tune_on_another_class_count_with_a_new_head(tmp_path):
    imagenet = resnet18_weights(1000)
    torch.save({"state_dict": prefixed("module.", imagenet), "epoch": 90}, tmp_path / "imagenet.pth")
    _, fresh = start_of(tmp_path, "fresh")
    result, tuned = start_of(tmp_path, "tuned", "--init-from", "imagenet.pth")
    assert ("starting from the weights in imagenet.pth (under 'state_dict', 'module.' dropped); fc.* left new: "
            "1000 classes there, 10 here") in result.stdout.splitlines()
    for name in ("conv1.weight", "layer4.1.bn2.weight", "layer2.0.downsample.0.weight"):
        assert torch.allclose(tuned[name], imagenet[name], atol=1e-6), name
    assert list(tuned["fc.weight"].shape) == [10, 512]
    for name in ("fc.weight", "fc.bias"):  # the head as a run without --init-from builds it
        assert torch.allclose(tuned[name], fresh[name], atol=1e-6), name


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["resnet34", "resnet50"])
def test_weights_of_another_arch_are_refused_whatever_their_class_count(tmp_path, arch):
    torch.save(getattr(torchvision.models, arch)().state_dict(), tmp_path / "other.pth")  # 1000 classes
    result = run_train("--out-dir", "run", *RUN, "--init-from", "other.pth", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [{
        "resnet34": "error: --init-from other.pth holds layer1.2.conv1.weight, which this run's resnet18 with 10 "
                    "classes does not have; give weights of the same --arch",
        "resnet50": "error: --init-from other.pth: layer1.0.conv1.weight is [64, 64, 1, 1] there, [64, 64, 3, 3] in "
                    "this run's resnet18 with 10 classes; give weights of the same --arch"}[arch]]
    assert not (tmp_path / "run").exists()


WRAPPED = {
    "bare state_dict": (lambda w: w, ""),
    "timm": (lambda w: {"state_dict": w, "state_dict_ema": w, "epoch": 3, "args": argparse.Namespace(lr=0.1)},
             " (under 'state_dict')"),
    "torchvision reference": (lambda w: {"model": w, "optimizer": {"state": {}}, "epoch": 3,
                                         "args": argparse.Namespace(model="resnet18", lr_steps=[16, 22])},
                              " (under 'model')"),
    "model_state_dict": (lambda w: {"model_state_dict": w}, " (under 'model_state_dict')"),
    "model_state": (lambda w: {"model_state": w}, " (under 'model_state')"),
    "net": (lambda w: {"net": w, "acc": 0.9}, " (under 'net')"),
    "DDP": (lambda w: prefixed("module.", w), " ('module.' dropped)"),
    "torch.compile": (lambda w: {"model": prefixed("_orig_mod.", w)}, " (under 'model', '_orig_mod.' dropped)"),
    "nested, DDP around torch.compile": (lambda w: {"checkpoint": 1, "state_dict": {"model": prefixed(
        "module._orig_mod.", w)}}, " (under 'state_dict', under 'model', 'module.' dropped, '_orig_mod.' dropped)"),
}


@pytest.mark.parametrize("kind", WRAPPED)
def test_other_scripts_checkpoints_load_their_weights(tmp_path, kind):
    weights = resnet18_weights(10)
    wrap, said = WRAPPED[kind]
    torch.save(wrap(weights), tmp_path / "other.pth")
    loaded, line = init_weights(Config(arch="resnet18", num_classes=10, init_from=str(tmp_path / "other.pth")))
    assert line == f"starting from the weights in {tmp_path / 'other.pth'}{said}"
    assert loaded.keys() == weights.keys() and all(torch.equal(loaded[k], weights[k]) for k in weights)


@pytest.mark.parametrize("content, why", [
    ({"state_dict": resnet18_weights(10), "args": {"output_dir": pathlib.PurePosixPath("out")}},
     "it names pathlib.PurePosixPath, which is not plain data; refused, nothing in it was run"),
    ({"weights": resnet18_weights(10)}, "it holds neither a checkpoint nor a state_dict of tensors"),
])
def test_a_wrapper_is_still_plain_data_only(tmp_path, content, why):
    torch.save(content, tmp_path / "other.pth")
    with pytest.raises(UsageError) as refused:
        init_weights(Config(arch="resnet18", num_classes=10, init_from=str(tmp_path / "other.pth")))
    assert str(refused.value) == f"cannot load {tmp_path / 'other.pth'}: {why}; check --init-from"
