"""python -m train.predict: a run's checkpoint classifies image files through the evaluation transform of
training, so on the run's validation folder its top-1 is --test-only's; unreadable files are skipped
and named, and bad input (no images, a file that is no checkpoint, a checkpoint whose weights are not
its arch's) is one line with exit 2. One short real run (resnet18, 32 px, the embedded dataset) serves
the module."""
import csv
import json
import shutil

import pytest
import torch

from data.embedded import ensure_embedded
from helpers import run_module, run_train, tiny_trained_run

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return tiny_trained_run(tmp_path_factory.mktemp("predict"))


def predict(*args, cwd):
    return run_module("train.predict", *args, cwd=cwd)


def refused(result, *words) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, (result.returncode, result.stderr)
    assert lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines[0]
    return lines[0]


@pytest.mark.slow(seconds=40)
def test_top1_on_the_validation_folder_is_test_onlys(trained):
    val = ensure_embedded() / "val"
    tested = run_train("--test-only", "--out-dir", trained / "run", cwd=trained)
    assert tested.returncode == 0, tested.stderr
    result = predict(trained / "run", val, "--labels-from-folders", "--json", "p.json", "--csv", "p.csv", cwd=trained)
    assert result.returncode == 0, result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert summary == tested.stdout.strip().splitlines()[-1], (summary, tested.stdout)
    assert summary.endswith("(300 images)") and not summary.startswith("top-1 0.1000"), summary  # a model that learnt
    predictions = json.loads((trained / "p.json").read_text())
    classes = torch.load(trained / "run" / "checkpoint.pt", weights_only=True)["classes"]
    assert len(predictions) == 300 and {p["label"] for p in predictions} == set(classes)
    first = predictions[0]
    assert [c["class"] for c in first["top_k"]] and len(first["top_k"]) == 5
    assert all(c["class"] == classes[c["index"]] for c in first["top_k"])
    probabilities = [c["probability"] for c in first["top_k"]]
    assert probabilities == sorted(probabilities, reverse=True) and 0 < sum(probabilities) <= 1.0001
    top1 = sum(p["top_k"][0]["class"] == p["label"] for p in predictions) / 300
    assert f"top-1 {top1:.4f}" in summary
    rows = list(csv.DictReader(open(trained / "p.csv")))
    assert len(rows) == 300 and rows[0]["path"] == first["path"] and rows[0]["class_1"] == first["top_k"][0]["class"]
    assert len(result.stdout.strip().splitlines()) == 1 + 300 + 1  # header, a row per image, the summary


@pytest.mark.slow
def test_an_unreadable_file_is_skipped_and_named_and_the_rest_classified(trained, tmp_path):
    source = sorted((ensure_embedded() / "val" / "blue_blobs").iterdir())
    folder = tmp_path / "photos" / "holiday"
    folder.mkdir(parents=True)
    for good in source[:2]:
        shutil.copy(good, folder / good.name)
    (folder / "cut.jpg").write_bytes(source[2].read_bytes()[:400])  # truncated
    (folder / "empty.png").write_bytes(b"")
    (folder / "notes.txt").write_text("not an image, not an image's name: not looked at")
    result = predict(trained / "run", tmp_path / "photos", "--top-k", 3, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    warnings = result.stderr.strip().splitlines()
    assert len(warnings) == 2, result.stderr
    assert any(w.startswith(f"warning: skipped {folder / 'cut.jpg'}: ") for w in warnings), warnings
    assert any(w.startswith(f"warning: skipped {folder / 'empty.png'}: ") for w in warnings), warnings
    rows = result.stdout.strip().splitlines()[1:]
    assert [row.split()[0] for row in rows] == [str(folder / good.name) for good in source[:2]]
    assert all(len(row.split()) == 1 + 3 * 2 for row in rows)  # the file, then 3 classes with their probabilities


@pytest.mark.slow
def test_a_folder_without_images_is_one_line(trained, tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "readme.txt").write_text("no image here")
    refused(predict(trained / "run", tmp_path / "docs", cwd=tmp_path), "no images found", "docs")
    refused(predict(trained / "run", tmp_path / "nowhere", cwd=tmp_path), "nowhere does not exist")


@pytest.mark.slow
def test_what_is_no_checkpoint_of_the_model_is_one_line(trained, tmp_path):
    image = sorted((ensure_embedded() / "val" / "blue_blobs").iterdir())[0]
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    refused(predict(tmp_path / "notes.txt", image, cwd=tmp_path), "cannot load", "notes.txt")
    refused(predict(tmp_path / "missing.pt", image, cwd=tmp_path), "missing.pt does not exist")
    refused(predict(tmp_path, image, cwd=tmp_path), "holds no checkpoint.pt")
    state = torch.load(trained / "run" / "checkpoint.pt", weights_only=True)
    torch.save(state["model"], tmp_path / "bare.pt")  # a state_dict, not a checkpoint of this trainer
    refused(predict(tmp_path / "bare.pt", image, cwd=tmp_path), "not a checkpoint of this trainer")
    state["config"]["arch"] = "resnet50"  # a resnet18's weights under another architecture's name
    torch.save(state, tmp_path / "other.pt")
    refused(predict(tmp_path / "other.pt", image, cwd=tmp_path), "resnet50", "differs")


def test_folders_are_searched_for_the_data_packages_image_extensions(tmp_path):
    from train.errors import UsageError
    from train.inference import find_images, preprocessing
    for name in ("b/2.JPEG", "b/sub/3.png", "a/1.webp", "a/notes.txt", "a/model.onnx", "c.TIFF"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "named.dat").write_bytes(b"")  # a file named on its own is taken whatever its name
    found = find_images([tmp_path / "a", tmp_path / "b", tmp_path / "c.TIFF", tmp_path / "named.dat", tmp_path / "a"])
    assert [str(p.relative_to(tmp_path)) for p in found] == ["a/1.webp", "b/2.JPEG", "b/sub/3.png", "c.TIFF", "named.dat"]
    with pytest.raises(UsageError, match="nowhere does not exist"):
        find_images([tmp_path / "nowhere"])
    assert {k: preprocessing(224)[k] for k in ("resize", "crop", "mean", "std")} == \
        {"resize": 256, "crop": 224, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def test_an_onnx_export_classifies_images_as_its_model_does(tmp_path, capsys):
    """The quick tier's: export_onnx with the metadata predict reads, then predict --onnx on real JPEGs
    in-process; each image's probabilities are the eager model's on the same batch: of the images alone
    for an export without `evaluation` metadata, and averaged with the mirror images' logits where it
    says the run's evaluation did (unless --no-flip). Unreadable `evaluation` metadata is one line."""
    import onnx
    from PIL import Image
    from models import build_model
    from train import predict as predict_module
    from train.export import export_onnx
    from train.inference import Images, preprocessing
    torch.manual_seed(0)
    model = build_model("resnet18", 3).eval()
    metadata = {"class_names": json.dumps(["ant", "bee", "cat"]), "preprocessing": json.dumps(preprocessing(32))}
    export_onnx(model, 32, tmp_path / "m.onnx", metadata)
    for i in range(3):
        Image.effect_noise((40 + 8 * i, 36), 60 + 40 * i).convert("RGB").save(tmp_path / f"{i}.jpg")
    paths = [tmp_path / f"{i}.jpg" for i in range(3)]
    images = Images(32, torch.device("cpu"))
    try:
        [(_, batch)] = list(images.batches(paths, 8, lambda path, why: pytest.fail(why)))
    finally:
        images.close()
    with torch.no_grad():
        alone = model(batch).softmax(dim=1)
        flipped = ((model(batch) + model(batch.flip(3))) / 2).softmax(dim=1)
    assert (alone - flipped).abs().max() > 1e-3  # (the mirror images change the figures)

    def classified(*flags):
        assert predict_module.main(["--onnx", str(tmp_path / "m.onnx"), *map(str, paths), "--top-k", "3",
                                    "--json", str(tmp_path / "p.json"), *flags]) == 0
        assert len(capsys.readouterr().out.splitlines()) == 4  # the header and a row per image
        return json.load(open(tmp_path / "p.json"))

    def same(results, expected):
        for result, row in zip(results, expected, strict=True):
            assert [c["class"] for c in result["top_k"]] == [["ant", "bee", "cat"][i] for i in row.argsort(descending=True)]
            assert all(abs(c["probability"] - float(row[c["index"]])) < 1e-4 for c in result["top_k"])

    same(classified(), alone)  # an export that says nothing of flips (written before it was recorded)
    same(classified("--flip"), flipped)
    proto = onnx.load(tmp_path / "m.onnx")
    proto.metadata_props.add(key="evaluation", value=json.dumps({"flip": True, "how": "..."}))
    onnx.save(proto, tmp_path / "m.onnx")
    same(classified(), flipped)
    same(classified("--no-flip"), alone)
    proto.metadata_props[-1].value = "flips, probably"
    onnx.save(proto, tmp_path / "m.onnx")
    assert predict_module.main(["--onnx", str(tmp_path / "m.onnx"), str(paths[0])]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --onnx ") and "'evaluation' metadata is not readable" in line, line


def test_the_table_lines_up_with_its_header_whatever_the_paths(capsys):
    """A path past 80 characters, or a folder name (--labels-from-folders) longer than every class name,
    widens its column: each row's columns start where the header's do, and each path is shown whole."""
    from pathlib import Path
    from train.predict import Table
    names = ["ant", "bee"]
    paths = [Path("bee/a.jpg"), Path("/data/" + "deep/" * 20 + "ant/b.jpg"), Path("/data/the_longest_folder_name/c.jpg")]
    assert len(str(paths[1])) > 100
    table = Table(paths, names, 2, labels=True)
    table.header()
    for path in paths:
        table.row({"path": str(path), "label": path.parent.name,
                   "top_k": [{"class": "ant", "probability": 0.75}, {"class": "bee", "probability": 0.25}]})
    header, *rows = capsys.readouterr().out.splitlines()
    # each header word starts where its cells do (or ends, "prob" over the right-aligned numbers)
    label, top1, top2 = (header.index(word) for word in ("label", "top-1", "top-2"))
    prob = header.index("prob") + len("prob")
    for path, row in zip(paths, rows, strict=True):
        assert row.startswith(f"{path} "), row  # whole
        assert row[label:].startswith(f"{path.parent.name} ") and row[:prob].endswith(" 0.7500"), (header, row)
        assert row[top1:].startswith("ant ") and row[top2:].startswith("bee "), (header, row)
