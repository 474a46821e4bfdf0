"""python -m train.export: a run's model as ONNX or torch.export's .pt2, fp32 with a dynamic batch,
carrying its class names and preprocessing, checked against the PyTorch model on the run's validation
images (removed, exit 1, when it does not match); predict --onnx gives the checkpoint's top-1; and
export_onnx, the function other code (the benchmark) calls. One short real run (resnet18, 32 px, the
embedded dataset) serves the module."""
import json
import re

import onnx
import onnxruntime
import pytest
import torch

from data.embedded import ensure_embedded
from helpers import run_module, tiny_trained_run
from models import build_model
from train.export import TOLERANCE, export_onnx
from train.inference import load_trained, preprocessing

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_trained_run(tmp_path_factory.mktemp("export"))


def export(*args, cwd):
    return run_module("train.export", *args, cwd=cwd)


def checked(result) -> float:
    """The largest logit difference the export's check printed (it passed: exit 0, top-1 the same)."""
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("check: "))
    assert "on 16 validation images of " in line and "top-1 the same on every image" in line, line
    difference = float(re.search(r"largest logit difference (\S+),", line).group(1))
    assert difference <= TOLERANCE, line
    return difference


def classes_of(run) -> list[str]:
    return torch.load(run / "checkpoint.pt", weights_only=True)["classes"]


def validation_batch(n: int) -> torch.Tensor:
    """n validation images through the evaluation transform (the one predict and the check use)."""
    from train.inference import Images
    paths = sorted((ensure_embedded() / "val").rglob("*.JPEG"))[::300 // n][:n]
    images = Images(32, torch.device("cpu"))
    try:
        return torch.cat([batch for _, batch in images.batches(paths, n, lambda *_: None)]).contiguous()
    finally:
        images.close()


@pytest.mark.slow(seconds=60)
def test_onnx_matches_the_checkpoint_and_predict_onnx_its_top1(trained):
    result = export(trained / "run", "--format", "onnx", "--out", "model.onnx", cwd=trained)
    checked(result)
    model = onnx.load(trained / "model.onnx")
    meta = {prop.key: prop.value for prop in model.metadata_props}
    assert json.loads(meta["class_names"]) == classes_of(trained / "run")
    assert json.loads(meta["preprocessing"]) == {**preprocessing(32), "mean": [0.485, 0.456, 0.406],
                                                 "std": [0.229, 0.224, 0.225], "resize": 37, "crop": 32,
                                                 "channel_order": "RGB", "layout": "NCHW"}
    # a run evaluated without flips, keeping no average (tests/test_predict_matches_test_only.py: one that did)
    assert json.loads(meta["evaluation"]) == {"flip": False, "how": "the logits of the image alone"}
    assert meta["weights"] == "trained"
    [images], [logits] = model.graph.input, model.graph.output
    assert (images.name, logits.name) == ("images", "logits")
    dims = images.type.tensor_type.shape.dim
    assert dims[0].dim_param and [d.dim_value for d in dims[1:]] == [3, 32, 32]  # the batch is dynamic
    assert images.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    # any batch size, the checkpoint's logits
    session = onnxruntime.InferenceSession(str(trained / "model.onnx"), providers=["CPUExecutionProvider"])
    reference = load_trained(trained / "run", torch.device("cpu")).model
    for n in (1, 5):
        batch = validation_batch(n)
        with torch.no_grad():
            expected = reference(batch)
        got = torch.from_numpy(session.run(None, {"images": batch.numpy()})[0])
        assert got.shape == (n, 10) and (got - expected).abs().max() <= TOLERANCE

    val = ensure_embedded() / "val"
    by_checkpoint = run_module("train.predict", trained / "run", val, "--labels-from-folders", cwd=trained)
    by_onnx = run_module("train.predict", "--onnx", trained / "model.onnx", val, "--labels-from-folders", cwd=trained)
    assert by_checkpoint.returncode == 0 and by_onnx.returncode == 0, by_checkpoint.stderr + by_onnx.stderr
    summary = by_onnx.stdout.strip().splitlines()[-1]
    assert summary.startswith("top-1 ") and summary == by_checkpoint.stdout.strip().splitlines()[-1]


@pytest.mark.slow(seconds=30)
def test_pt2_matches_the_checkpoint_and_carries_its_facts_beside_it(trained):
    result = export(trained / "run", "--format", "pt2", "--out", "model.pt2", cwd=trained)
    checked(result)
    facts = json.loads((trained / "model.pt2.json").read_text())
    assert facts["class_names"] == classes_of(trained / "run") and facts["preprocessing"] == preprocessing(32)
    assert facts["evaluation"] == {"flip": False, "how": "the logits of the image alone"} and facts["weights"] == "trained"
    extra = {"metadata.json": ""}
    program = torch.export.load(trained / "model.pt2", extra_files=extra)
    assert json.loads(extra["metadata.json"]) == facts
    reference = load_trained(trained / "run", torch.device("cpu")).model
    for n in (1, 7):  # any batch size
        batch = validation_batch(n)
        with torch.no_grad():
            got, expected = program.module()(batch), reference(batch)
        assert got.shape == (n, 10) and (got - expected).abs().max() <= TOLERANCE


@pytest.mark.slow(seconds=30)
def test_an_export_that_does_not_match_is_removed_with_exit_1(trained):
    # ONNX Runtime's kernels are not PyTorch's: no export matches to 0, so the check fails as it would above 1e-4
    result = export(trained / "run", "--format", "onnx", "--out", "strict.onnx", "--tolerance", 0, cwd=trained)
    assert result.returncode == 1, (result.stdout, result.stderr)
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: the export does not match the model") and "strict.onnx removed" in line
    assert not (trained / "strict.onnx").exists()


@pytest.mark.slow
def test_bad_input_is_one_line(trained, tmp_path):
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    for args, words in (((tmp_path / "notes.txt", "--format", "onnx", "--out", "m.onnx"), ("cannot load", "notes.txt")),
                        ((tmp_path, "--format", "pt2", "--out", "m.pt2"), ("holds no checkpoint.pt",)),
                        ((trained / "run", "--format", "onnx", "--out", tmp_path / "no" / "m.onnx"), ("does not exist",))):
        result = export(*args, cwd=tmp_path)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    assert not list(tmp_path.glob("m.*"))


@pytest.mark.slow
def test_export_onnx_takes_any_model_for_the_benchmark(tmp_path):
    model = build_model("resnet18", 3, channels_last=True).eval()  # as a run builds it
    export_onnx(model, 32, tmp_path / "bench.onnx", {"purpose": "benchmark"})
    proto = onnx.load(tmp_path / "bench.onnx")
    onnx.checker.check_model(proto)
    assert {p.key: p.value for p in proto.metadata_props} == {"purpose": "benchmark"}
    session = onnxruntime.InferenceSession(str(tmp_path / "bench.onnx"), providers=["CPUExecutionProvider"])
    for n in (1, 3):
        batch = torch.randn(n, 3, 32, 32)
        with torch.no_grad():
            expected = model(batch)
        assert (torch.from_numpy(session.run(["logits"], {"images": batch.numpy()})[0]) - expected).abs().max() <= TOLERANCE
    assert next(model.parameters()).is_contiguous(memory_format=torch.channels_last)  # the caller's model untouched
