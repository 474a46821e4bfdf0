"""--test-only reads only the validation split of the run's data (or --data-dir), and refuses, in one
line with exit 2, a model --arch does not build from the checkpoint and data whose classes are not the
run's (the same count with other names would be scored silently, near 0); a resumed run is held to its
classes the same way."""
import pytest

from helpers import run_train
from test_errors import make_tree

RUN = ["--arch", "resnet18", "--image-size", 32, "--workers", 0, "--global-batch-size", 4, "--eval-every", 0,
       "--max-steps", 1, "--epochs", 2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("test_only")
    make_tree(root / "data", ["apple", "pear"], ["apple", "pear"])
    done = run_train("--data-dir", root / "data", "--out-dir", root / "run", *RUN, cwd=root)
    assert done.returncode == 0, done.stderr
    return root


def refused(result, *words):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), result.stderr
    return lines[0]


@pytest.mark.slow
def test_another_arch_is_one_line(trained):
    result = run_train("--test-only", "--out-dir", trained / "run", "--arch", "resnet50", cwd=trained)
    refused(result, "holds a resnet18", "--arch resnet50")


@pytest.mark.slow
def test_data_with_other_class_names_is_refused_by_name(trained, tmp_path):
    make_tree(tmp_path / "other", ["apple", "plum"], ["apple", "plum"])  # as many classes, another name
    result = run_train("--test-only", "--out-dir", trained / "run", "--data-dir", tmp_path / "other", cwd=tmp_path)
    refused(result, "not the run's", "'plum'", "'pear'")
    again = run_train("--resume", "--out-dir", trained / "run", "--data-dir", tmp_path / "other", "--max-steps", 2,
                      cwd=tmp_path)
    refused(again, "not those of the run")


@pytest.mark.slow
def test_a_training_split_smaller_than_a_global_batch_does_not_stop_an_evaluation(trained, tmp_path):
    make_tree(tmp_path / "small", ["apple", "pear"], ["apple", "pear"], images_per_class=1)  # 2 < global batch 4
    result = run_train("--test-only", "--out-dir", trained / "run", "--data-dir", tmp_path / "small", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("(2 images)")
