"""--fp16-allreduce's wire (train/engines/wire.py, docs/allreduce.md): the run's own half type where
the engine can send it, the average split around the sum so that neither end over- or underflows, on
every engine and all-reduce with the real launchers; and (torch.distributed) every process group the
engine makes carries TRAINER_COLLECTIVE_TIMEOUT_S's backstop (docs/cluster.md)."""
import json
import types

import pytest
import torch

from helpers import REPO, launch, run_train
from train.config import Config
from train.engines import wire
from train.engines.single import SingleProcess

CPU = torch.device("cpu")


def test_the_average_is_split_around_the_sum_by_powers_of_two():
    for ranks, k in [(1, 0), (2, 0), (3, 0), (4, 1), (8, 1), (64, 3), (2528, 5)]:
        factor, divisor = wire.split_average(ranks)
        assert factor == 2.0 ** -k and divisor == ranks / 2 ** k and factor / divisor == 1 / ranks


@pytest.mark.parametrize("precision, sends_bf16, dtype, note", [
    ("fp32", True, torch.float16, None),
    ("auto", True, torch.float16, None),  # (fp32 on CPU)
    ("bf16", True, torch.bfloat16, "--fp16-allreduce: gradients travel as bf16, this bf16 run's own half type "
                                   "(fp16 would flush its small gradients to zero)"),
    ("bf16", False, None, "--fp16-allreduce: gradients travel as fp32 in this bf16 run (Horovod cannot send bf16, "
                          "and fp16 would flush its small gradients to zero)"),
])
def test_the_wire_is_the_runs_own_half_type_where_the_engine_can_send_it(precision, sends_bf16, dtype, note):
    cfg = Config(precision=precision, fp16_allreduce=True)
    assert wire.choose(cfg, CPU, sends_bf16) == (dtype, note)
    assert wire.choose(Config(precision=precision), CPU, sends_bf16) == (None, None)  # without the flag: as it was


def test_an_fp16_run_sends_fp16(monkeypatch):
    monkeypatch.setenv("TRAINER_ALLOW_CPU_FP16", "1")
    assert wire.choose(Config(precision="fp16", fp16_allreduce=True), CPU, sends_bf16=True) == (torch.float16, None)


# docs/allreduce.md's table, fp16 wire: ranks -> (largest per-rank gradient whose sum does not overflow,
# smallest kept to fp16's rounding)
FP16_RANGE = {4: (32752, 1.2207e-4), 64: (8188, 4.8828e-4), 2528: (829.1, 1.9531e-3)}


@pytest.mark.parametrize("ranks", FP16_RANGE)
def test_the_split_keeps_the_documented_fp16_range(ranks):
    largest, smallest = FP16_RANGE[ranks]
    factor, _ = wire.split_average(ranks)

    def wire_sum(gradient: float) -> torch.Tensor:  # every rank's gradient x 2^-k in fp16, summed (rounded once)
        return torch.full((ranks,), gradient * factor).half().sum()

    assert wire_sum(largest).isfinite() and not wire_sum(largest * 1.01).isfinite()
    tiny = torch.finfo(torch.float16).tiny  # fp16's smallest normal number: full precision from there up
    assert torch.tensor(smallest * factor).half() >= tiny > torch.tensor(smallest / 1.01 * factor).half()


def test_fp16_allreduce_on_one_process_says_it_does_nothing():
    assert SingleProcess(Config(fp16_allreduce=True)).wire_note == \
        "--fp16-allreduce does nothing on one process: there are no gradients to exchange"
    assert SingleProcess(Config()).wire_note is None


def test_the_runs_output_says_it_once(tmp_path):
    done = run_train("--out-dir", "run", "--fp16-allreduce", "--loader", "synthetic", "--arch", "resnet18",
                     "--image-size", 16, "--synthetic-images", 16, "--batch-size", 4, "--max-steps", 1,
                     "--eval-every", 0, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(wire.NOT_ON_ONE_PROCESS) == 1


TIMEOUT_S = 97  # TRAINER_COLLECTIVE_TIMEOUT_S for the launch: the groups' is 30 s more (network.BACKSTOP_S)


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", pytest.param("horovod", marks=pytest.mark.alone)])
def test_every_all_reduce_averages_on_its_wire_without_over_or_underflow(engine, tmp_path):
    """tests/helpers/wire_check.py on 4 ranks (2 nodes of 2 for hierarchical and torus): bf16 runs'
    gradients of 1e-20 and 1e20, fp16 wire's of 3e4 (four overflow fp16 when summed as they are) and
    1e-4, against the exact mean. Fails with fp16 sent in a bf16 run (1e-20 -> 0, 1e20 -> inf), or a
    sum before the division on the fp16 wire (Horovod's average, the two-level all-reduces: inf)."""
    result = launch(engine, 4, REPO / "tests" / "helpers" / "wire_check.py", engine, tmp_path, cwd=tmp_path,
                    timeout=300, env={"TRAINER_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)})
    # (the first rank to fail says why at the start; the others' connection errors follow)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[:4000] + "\n...\n" + result.stderr[-2000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    bf16 = wire.choose(types.SimpleNamespace(fp16_allreduce=True, precision="bf16"), CPU, engine == "torch")
    for rank in ranks:
        for case, figures in rank["cases"].items():
            wire_type, _ = case.split()
            assert figures["finite"], (rank["rank"], case)
            worst = max(figures["relative_error"])  # per kind: tiny and huge, or 3e4 and 1e-4
            if wire_type == "bf16" and engine == "horovod":
                # fp32 on the wire (Horovod refuses bf16): the mean to fp32's rounding, and the run says so
                assert worst <= 1e-6 and figures["note"] == bf16.note, (rank["rank"], case)
            else:
                # each rank's gradient, and each of the up to 3 partial sums, rounded once to the wire
                # type (unit roundoff u = 2^-8 for bf16, 2^-11 for fp16): within 4u; above fp32's
                # rounding, so the half type really went on the wire
                u = 2 ** -8 if wire_type == "bf16" else 2 ** -11
                assert 1e-6 < worst <= 4 * u, (rank["rank"], case, figures["relative_error"])
                assert figures["note"] == (bf16.note if wire_type == "bf16" else None)
        if engine == "torch":  # the world, the lines and columns (twice: the hook's steps), the span group
            assert rank["groups"] == 6 and rank["group_timeouts_s"] == [TIMEOUT_S + 30], rank
