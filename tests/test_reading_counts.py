"""scripts/reading_counts.py's profile hook, on a small made-up checkout whose code is known: what it
counts as entered before the first optimizer step, and as followed from the outermost function to it."""
import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "reading_counts.py"

LOOP = '''
def main(optimizer, read):
    prepare(read)
    for _ in range(2):
        step(optimizer)
        log_step()  # after the first step: not counted
    after()

def prepare(read):
    return [read() for _ in range(1)]  # (the comprehension is part of prepare)

def step(optimizer):
    optimizer.step()

def log_step():
    pass

def after():
    pass

def never_called():
    pass
'''

READER = '''
def read():
    return _decode()

def _decode():
    return 1
'''


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_hook_counts_the_checkouts_functions_up_to_the_first_optimizer_step(tmp_path):
    for folder, text in (("train", LOOP), ("data", READER)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "code.py").write_text(text)
    (tmp_path / "elsewhere.py").write_text(READER)  # outside train/, data/, models/: never counted
    recorder = load(SCRIPT, "reading_counts").Recorder(tmp_path)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sys.setprofile(recorder.hook)
    try:
        loop = load(tmp_path / "train" / "code.py", "made_up_loop")
        reader = load(tmp_path / "data" / "code.py", "made_up_reader")
        other = load(tmp_path / "elsewhere.py", "made_up_elsewhere")
        loop.main(optimizer, lambda: (other.read(), reader.read()))
    finally:
        sys.setprofile(None)
    counts = recorder.counts()
    assert sorted(counts["entered"]) == ["data/code.py:_decode", "data/code.py:read", "train/code.py:main",
                                         "train/code.py:prepare", "train/code.py:step"]
    assert (counts["functions_entered"], counts["files_entered"], counts["modules_imported"]) == (5, 2, 2)
    assert counts["stack_at_step"] == ["train/code.py:main", "train/code.py:step"]
    assert counts["own_frames_of_step"] == ["train/code.py:step"]  # main's frame is still there at step 2
    # the stack's functions and what they called: prepare's own calls are not on the path (it had returned)
    assert counts["followed"] == ["train/code.py:main", "train/code.py:prepare", "train/code.py:step"]
    assert counts["followed_before_step"] == 2  # main and prepare, entered before the step's own frame
