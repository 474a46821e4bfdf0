"""Stopping together: a signal that asks the run to stop (StopSignal), and the steps at which the ranks
agree on it and on rank 0's checkpoint clock (FlagChecks).

An agreement is an all-reduce of a few numbers over every rank, on the host: latency-bound, it costs
about 2 x (ranks - 1) network hops, a tenth of a second at 2,528 ranks, where a step takes milliseconds.
So the ranks space their agreements by what they cost: each rank measures what the last agreement took
and what a step takes, and proposes the next interval, as many steps as keep an agreement at most
AGREEMENT_SHARE of the training time, and no more than AGREEMENT_LONGEST_S of training apart (a
scheduler's warning signal comes minutes before the end). The proposals ride in the agreement itself,
whose largest is every rank's next interval, so the ranks meet at the same step without a word more.
The planner counts what remains (train/plan/model.py). With one rank nothing is exchanged: every step
is a point of agreement. `--stop-check-every N` fixes the interval instead.
"""
import math
import signal
import time

AGREEMENT_SHARE = 0.005  # of the training time, at most, spent agreeing
AGREEMENT_LONGEST_S = 30.0  # of training between agreements, at most
FIRST_INTERVAL = 10  # steps to the first agreement of a segment, before any is measured


def interval(agreement_s: float, step_s: float, share: float = AGREEMENT_SHARE,
             longest_s: float = AGREEMENT_LONGEST_S) -> int:
    """Steps between agreements that cost `agreement_s` each, at `step_s` a step: enough that the
    agreement is at most `share` of the time, no more than `longest_s` of steps, at least 1."""
    enough = math.ceil(agreement_s / (share * step_s)) if step_s > 0 else FIRST_INTERVAL
    return max(1, min(enough, math.floor(longest_s / step_s) if step_s > 0 else enough))


class FlagChecks:
    """The steps at which the ranks exchange their flags (a stop signal, rank 0's checkpoint clock) and
    agree on them: every rank calls due() at every step, and exchange() when due."""

    def __init__(self, every: int = 0):
        self.every = every  # --stop-check-every (0: by the measured cost)
        self.restart(0)

    def restart(self, step: int) -> None:
        """A segment (a resume, a Horovod Elastic rollback or state sync) starts at `step` on every rank alike."""
        self.next_step = step + (self.every or FIRST_INTERVAL)
        self.agreement_s = None  # what the last agreement took (None: none measured yet)
        self.since = (step, time.perf_counter())  # (step, clock) after the last agreement

    def due(self, step: int, world_size: int) -> bool:
        return world_size == 1 or step >= self.next_step

    def exchange(self, engine, step: int, flags: list[bool]) -> list[bool]:
        """Each flag true on every rank when it is true on any (host-side, no device sync); the next
        agreement's step chosen, alike on every rank."""
        if engine.world_size == 1:
            return list(flags)
        started = time.perf_counter()
        first_step, first_clock = self.since
        step_s = (started - first_clock) / max(1, step - first_step)
        proposal = self.every or (interval(self.agreement_s, step_s) if self.agreement_s is not None else FIRST_INTERVAL)
        *flags_anywhere, chosen = engine.max_over_ranks([int(flag) for flag in flags] + [proposal])  # the largest of each, over ranks
        done = time.perf_counter()
        self.agreement_s, self.since, self.next_step = done - started, (step, done), step + chosen
        return [bool(value) for value in flags_anywhere]


class StopSignal:
    """Remembers a SIGUSR1 or SIGTERM (Slurm's warning before the time limit, a scheduler's stop) or
    a SIGINT (Ctrl-C) while the run trains: the run checkpoints and stops at the ranks' next
    agreement. A second Ctrl-C stops at once."""
    SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)

    def __enter__(self) -> "StopSignal":
        self.raised = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        self.raised = True
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.default_int_handler)
