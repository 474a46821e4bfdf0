import errno

import pytest
import torch

from train import checkpoint
from train.schedule import EvalPlan


def test_save_replaces_atomically_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, {"step": 1, "model": {"w": torch.ones(3)}})
    assert checkpoint.load(path, torch.device("cpu"))["step"] == 1
    before = path.read_bytes()

    def disk_full(obj, f):
        f.write(b"partial bytes")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError):
        checkpoint.save(path, {"step": 2})
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left behind


@pytest.mark.parametrize("every, offset, expected", [(4, 0, [4, 8, 10]), (4, 3, [1, 5, 9, 10]), (1, 0, list(range(1, 11)))])
def test_eval_epochs_follow_every_and_offset(every, offset, expected):
    plan = EvalPlan(every, offset, epochs=10)
    due = [e for e in range(1, 11) if plan.due(e) or e == 10]
    assert due == expected
    # MLLOG blocks run from the epoch after an eval to the next eval (or the end)
    starts = [e for e in range(1, 11) if plan.starts_block(e)]
    assert starts == [1] + [e + 1 for e in expected[:-1]]
    assert [plan.next_eval(s) for s in starts] == expected
    assert [plan.block_start(e) for e in expected] == starts
