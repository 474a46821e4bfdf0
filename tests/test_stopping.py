"""The ranks' agreement on stopping at scale (train/stopping.py): spaced by what it costs, so that its
share of the training time does not grow with the rank count, and alike on every rank however their
measurements differ; the planner counts what remains (under 1% of a step at the 2,528-GPU preset,
where an agreement every 10 steps would cost more than the step itself)."""
import threading
import time

import pytest

from train.plan import model
from train.plan.cli import parser, plans, system_of
from train.stopping import AGREEMENT_LONGEST_S, AGREEMENT_SHARE, FlagChecks, interval


def test_the_interval_keeps_the_agreement_a_small_share_and_a_signal_close():
    assert interval(0.001, 0.1) == 2  # 1 ms every 2 steps of 100 ms: 0.5%
    assert interval(0.002, 0.004) == 100  # 2 ms agreements, 4 ms steps: 0.5% every 100 steps
    assert interval(0.15, 0.0057) == int(AGREEMENT_LONGEST_S / 0.0057)  # 2,528 ranks: held to 30 s of steps
    assert interval(0.0, 0.01) == interval(1e-6, 60.0) == 1  # free agreements, or steps longer than the limit
    for agreement_s, step_s in [(0.01, 0.001), (0.3, 0.02), (1e-4, 0.5)]:
        steps = interval(agreement_s, step_s)
        assert agreement_s / (steps * step_s) <= AGREEMENT_SHARE or steps * step_s > AGREEMENT_LONGEST_S - step_s


class TwoRanks:
    """An engine for two threads standing in for two ranks: max_over_ranks() is the elementwise largest of both
    ranks' values, and costs this rank `delay` seconds more once they have met (so the two measure
    different costs and propose different intervals)."""

    def __init__(self):
        self.world_size, self.values, self.barrier, self.calls = 2, {}, threading.Barrier(2, timeout=20), 0

    def rank(self, rank: int, delay: float):
        engine = self

        class Rank:
            world_size = 2

            def max_over_ranks(self, values):
                engine.values[rank] = values
                engine.barrier.wait()
                largest = [max(pair) for pair in zip(*engine.values.values())]
                engine.barrier.wait()
                time.sleep(delay)
                return largest
        return Rank()


def test_the_ranks_agree_at_the_same_steps_and_space_them_by_their_cost():
    """Two ranks that measure different costs still meet at the same steps (the larger proposal wins);
    a stop signal on one is every rank's; an agreement that costs 200 steps' worth is held every 200 x
    (1 / 0.005) steps... or so: far apart, as against every 10 steps before."""
    ranks, steps_agreed, stops = TwoRanks(), {0: [], 1: []}, {0: [], 1: []}

    def train(rank: int):
        agreements = FlagChecks()
        for step in range(1, 2001):
            time.sleep(0.0002)  # a step of about 0.2 ms
            if agreements.due(step, 2):
                steps_agreed[rank].append(step)  # (before agreeing: a rank left waiting alone shows too)
                stop, = agreements.exchange(ranks.rank(rank, 0.01 if rank == 0 else 0.001), step, [rank == 1 and step >= 10])
                stops[rank].append(stop)
    threads = [threading.Thread(target=train, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert steps_agreed[0] == steps_agreed[1] and stops[0] == stops[1]
    assert steps_agreed[0][0] == 10 and stops[0][0]  # the first agreement, at step 10, carries rank 1's signal
    # 10 ms agreements against ~0.2 ms steps: the next ones thousands of steps apart, not every 10
    assert len(steps_agreed[0]) <= 3, steps_agreed[0]


def test_a_fixed_interval_and_one_rank():
    agreements = FlagChecks(every=3)
    assert [step for step in range(1, 10) if agreements.due(step, 2) and agreements.exchange(Single(), step, [False]) == [False]] \
        == [3, 6, 9]
    assert all(FlagChecks().due(step, 1) for step in range(1, 5))  # one rank: every step, nothing exchanged
    restarted = FlagChecks()
    restarted.restart(500)  # a resume, a rollback: the next agreement counted from there on every rank
    assert not restarted.due(509, 2) and restarted.due(510, 2)


class Single:
    world_size = 2

    @staticmethod
    def max_over_ranks(values):
        return values


def test_the_planner_counts_the_agreement_under_one_percent_at_2528_gpus():
    args = parser().parse_args(["--preset", "nvidia-mlperf40-2528gpu", "--gpus", "2528", "--gpu", "h100"])
    row = plans(system_of(args), [2528])[0][0]
    assert 0 < row["agreement_s"] < 0.01 * row["step_s"]
    every_ten = 2 * 2527 * model.HOST_HOP_S / 10  # what an agreement every 10 steps would cost a step
    assert every_ten > row["step_s"]
    assert model.agreement_per_step(1, 0.01) == 0


@pytest.mark.parametrize("gpus", [64, 512, 2528])
def test_the_agreements_share_does_not_grow_with_the_rank_count(gpus):
    step_s = 0.0057
    assert model.agreement_per_step(gpus, step_s) / step_s <= AGREEMENT_SHARE * 1.02
