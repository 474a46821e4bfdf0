import errno

import pytest
import torch

from train import checkpoint, host_memory
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


def test_host_copies_are_copies_and_their_memory_is_reused_only_once_none_is_alive():
    """A copy someone keeps (a Horovod Elastic commit) stays as it was while later copies are made; the
    memory of copies that are gone is used again."""
    weights = {"w": torch.arange(1000.0), "n": torch.tensor(7), "empty": torch.zeros(0, 3)}
    kept = host_memory.host_copy({"model": weights, "step": 1, "pair": (1, [2])})
    assert kept["step"] == 1 and kept["pair"] == (1, [2]) and kept["model"]["empty"].shape == (0, 3)
    weights["w"].add_(1)  # training goes on
    weights["n"].fill_(8)
    later = host_memory.host_copy({"model": weights})
    assert torch.equal(kept["model"]["w"], torch.arange(1000.0)) and int(kept["model"]["n"]) == 7
    assert torch.equal(later["model"]["w"], torch.arange(1000.0) + 1) and int(later["model"]["n"]) == 8
    assert later["model"]["w"].data_ptr() != kept["model"]["w"].data_ptr()
    for tensor in (*kept["model"].values(), *later["model"].values()):
        assert tensor.data_ptr() != weights["w"].data_ptr() and not tensor.requires_grad
    view = later["model"]["w"][10:20]  # a view keeps its copy's memory taken, as the copy itself does
    address = later["model"]["w"].data_ptr()
    del later
    again = host_memory.host_copy({"model": weights})
    assert again["model"]["w"].data_ptr() not in (address, kept["model"]["w"].data_ptr())
    assert torch.equal(view, torch.arange(10.0, 20.0) + 1)
    del view, again
    reused = host_memory.host_copy({"model": weights})
    assert reused["model"]["w"].data_ptr() == address
    assert len(host_memory.HOST_MEMORY.arenas) == 2  # the kept copy's and this one's; free ones are let go


def test_reserved_host_memory_is_what_the_first_checkpoint_copies_into():
    """host_memory.reserve pages in (after the first step) the memory the next host copy of the same
    state takes, so the first checkpoint does not pay for it in its step."""
    state = {"model": {"w": torch.randn(4096)}, "optimizer": {"state": {0: {"m": torch.randn(4096)}}}, "step": 1}
    host_memory.reserve(state)
    reserved = {arena.address for arena in host_memory.HOST_MEMORY.arenas}
    copy = host_memory.host_copy(state)
    assert {arena.address for arena in host_memory.HOST_MEMORY.arenas} == reserved
    assert any(arena.holds(copy["model"]["w"]) and arena.address in reserved for arena in host_memory.HOST_MEMORY.arenas)


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
