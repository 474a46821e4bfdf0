"""predict classifies as the run's evaluation does, so on the run's validation folder its top-1 and top-5
are --test-only's, on a run that evaluated with every option that changes the figure: flips
(--eval-flip), a size other than its training size (--eval-image-size), BlurPool and an --ema-decay
average. Through --test-only's torch loader exactly; through its DALI loader (CPU operators) exactly on
every image that is not a near tie. predict --onnx the same (its flips from the export's metadata);
--no-flip and --flip against the run's setting; --raw-weights the trained weights for predict (as for
--test-only --raw-weights) and export.
One short real run (resnet18, trained at 32 px, evaluated at 40, the embedded dataset) serves the module."""
import json
import shutil

import onnx
import pytest
import torch

from data.embedded import ensure_embedded
from helpers import TINY_TRAINED_RUN, run_module, run_train
from helpers.gpu import require_dali
from models import build_model
from train.export import TOLERANCE

EVAL_SIZE = 40
EVALUATED_RUN = [*TINY_TRAINED_RUN, "--eval-image-size", EVAL_SIZE, "--eval-flip", "--blurpool", "--ema-decay", 0.9]
FLIPPED = {"flip": True, "how": "mean of the logits of the image and its left-right mirror"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run directory of the tiny run with flips, another evaluation size, BlurPool and the average."""
    root = tmp_path_factory.mktemp("evaluated")
    done = run_train("--out-dir", root / "run", *EVALUATED_RUN, cwd=root)
    assert done.returncode == 0, done.stderr
    config = torch.load(root / "run" / "checkpoint.pt", weights_only=True)["config"]
    evaluated = [config[name] for name in ("eval_flip", "eval_image_size", "blurpool", "ema_decay")]
    assert evaluated == [True, EVAL_SIZE, True, 0.9], evaluated
    return root / "run"


def summary(result) -> str:
    """The last line of a command that ended well: `top-1 X  top-5 Y  (N images)` for these."""
    assert result.returncode == 0, result.stderr
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("top-1 "), result.stdout[-2000:]
    return line


def predicted(*args, cwd) -> tuple[str, dict]:
    """predict's summary over the embedded validation folder, and its probabilities of every class by image."""
    out = cwd / "predictions.json"
    line = summary(run_module("train.predict", *args, ensure_embedded() / "val", "--labels-from-folders", "--top-k", 10,
                              "--json", out, cwd=cwd))
    return line, {p["path"]: {c["class"]: c["probability"] for c in p["top_k"]} for p in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def by_predict(run):
    """predict as a user runs it on the run: its summary and probabilities."""
    return predicted(run, cwd=run.parent)


@pytest.mark.slow(seconds=25)
def test_predict_is_test_only_on_the_torch_loader(run, by_predict):
    tested = summary(run_train("--test-only", "--out-dir", run, "--loader", "torch", cwd=run.parent))
    assert by_predict[0] == tested and tested.endswith("(300 images)")
    assert not tested.startswith("top-1 0.1"), tested  # a model that learnt: the flips can move its figure


# DALI resamples in float, the torch loader in fixed point: their evaluation pixels differ by up to one
# level of 255 (docs/settings.md), which moved this run's logits by up to 0.006 (measured over the 300
# images, flips averaged). An image with two classes nearer than this in logit can rank them either way
NEAR_TIE = 0.05


def near_ties(run) -> set[str]:
    """The validation images whose hits could go either way: the flip-averaged logits (the average's
    weights, the evaluation transform of predict) put their label within NEAR_TIE of the best other
    class (the top-1 border) or of the fifth best (the top-5 border)."""
    from train.inference import Images
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    model = build_model("resnet18", 10, blurpool=True)
    model.load_state_dict(state["ema"])
    model.eval()
    paths = sorted((ensure_embedded() / "val").rglob("*.JPEG"))
    images, close = Images(EVAL_SIZE, torch.device("cpu")), set()
    try:
        for batch_paths, batch in images.batches(paths, 100, lambda path, why: pytest.fail(f"{path}: {why}")):
            with torch.no_grad():
                logits = (model(batch) + model(batch.flip(3))) / 2
            for path, row in zip(batch_paths, logits):
                label = state["classes"].index(path.parent.name)
                others = torch.cat([row[:label], row[label + 1:]]).sort(descending=True).values
                if min(abs(row[label] - others[0]), abs(row[label] - others[4])) < NEAR_TIE:
                    close.add(str(path))
    finally:
        images.close()
    return close


@pytest.mark.slow(seconds=30)
def test_predict_is_test_only_on_the_dali_loader_on_every_image_but_near_ties(run, tmp_path):
    require_dali()
    close = near_ties(run)
    data = tmp_path / "data"  # the validation images that are no near tie, and a training image a class (looked at, not read)
    kept = 0
    for folder in sorted((ensure_embedded() / "val").iterdir()):
        (data / "val" / folder.name).mkdir(parents=True)
        (data / "train" / folder.name).mkdir(parents=True)
        images = sorted(folder.iterdir())
        shutil.copy(images[0], data / "train" / folder.name)
        for image in images:
            if str(image) not in close:
                shutil.copy(image, data / "val" / folder.name)
                kept += 1
    assert kept >= 250, f"{300 - kept} of 300 images near a tie"
    tested = summary(run_train("--test-only", "--out-dir", run, "--loader", "dali", "--data-dir", data, cwd=tmp_path))
    line = summary(run_module("train.predict", run, data / "val", "--labels-from-folders", cwd=tmp_path))
    assert line == tested and tested.endswith(f"({kept} images)")


@pytest.mark.slow(seconds=40)
def test_predict_onnx_is_predict_with_the_flips_from_the_exports_metadata(run, by_predict, tmp_path):
    exported = run_module("train.export", run, "--format", "onnx", "--out", tmp_path / "m.onnx", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    meta = {prop.key: prop.value for prop in onnx.load(tmp_path / "m.onnx").metadata_props}
    assert json.loads(meta["evaluation"]) == FLIPPED and meta["weights"] == "ema_average"
    line, probabilities = predicted("--onnx", tmp_path / "m.onnx", cwd=tmp_path)
    assert line == by_predict[0]
    for path, expected in by_predict[1].items():
        assert all(abs(p - expected[name]) <= 1e-4 for name, p in probabilities[path].items()), path


@pytest.mark.slow(seconds=30)
def test_no_flip_classifies_as_the_run_would_have_without_flips(run, by_predict, tmp_path):
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    state["config"]["eval_flip"] = False  # the same weights, evaluated without flips
    torch.save(state, tmp_path / "unflipped.pt")
    not_flipped = predicted(run, "--no-flip", cwd=tmp_path)
    assert not_flipped == predicted(tmp_path / "unflipped.pt", cwd=tmp_path)
    assert not_flipped[1] != by_predict[1]
    assert predicted(tmp_path / "unflipped.pt", "--flip", cwd=tmp_path) == by_predict


@pytest.mark.slow(seconds=40)
def test_raw_weights_are_the_trained_weights_not_the_average(run, by_predict, tmp_path):
    state = torch.load(run / "checkpoint.pt", weights_only=True)
    del state["ema"]  # the run as if it kept no average: it evaluated its trained weights
    torch.save(state, tmp_path / "trained.pt")
    raw = predicted(run, "--raw-weights", cwd=tmp_path)
    assert raw == predicted(tmp_path / "trained.pt", cwd=tmp_path)
    assert raw == predicted(tmp_path / "trained.pt", "--raw-weights", cwd=tmp_path)  # (nothing refused: the same weights)
    assert raw[1] != by_predict[1]
    assert raw[0] == summary(run_train("--test-only", "--out-dir", run, "--raw-weights", cwd=tmp_path))

    exported = run_module("train.export", run, "--format", "pt2", "--out", tmp_path / "raw.pt2", "--raw-weights", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    facts = json.loads((tmp_path / "raw.pt2.json").read_text())
    assert facts["weights"] == "trained" and facts["evaluation"] == FLIPPED
    models = {}
    for name in ("model", "ema"):
        models[name] = build_model("resnet18", 10, blurpool=True).eval()
        models[name].load_state_dict(torch.load(run / "checkpoint.pt", weights_only=True)[name])
    batch = torch.randn(4, 3, EVAL_SIZE, EVAL_SIZE)
    with torch.no_grad():
        got = torch.export.load(tmp_path / "raw.pt2").module()(batch)
        assert (got - models["model"](batch)).abs().max() <= TOLERANCE
        assert (got - models["ema"](batch)).abs().max() > 100 * TOLERANCE
