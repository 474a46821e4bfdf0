"""Progress of a long wait (indexing a folder, an evaluation, writing shards, preparing ImageNet): a
plain line at most once every few seconds, to a terminal or a file alike, saying what is being done,
how far it is and, where the total is known, when it should end. Plain Python (no torch): data/,
train/ and scripts/ all use it.

Environment: TRAINER_PROGRESS_EVERY_S, the least time between two lines of one wait (default 5; 0:
a line at every tick, as the tests set it)."""
import os
import sys
import time

EVERY_S = 5.0  # the least time between two lines of one wait, unless TRAINER_PROGRESS_EVERY_S says otherwise


def default_every_s() -> float:
    """TRAINER_PROGRESS_EVERY_S when it holds a number of seconds, else EVERY_S."""
    try:
        return max(0.0, float(os.environ["TRAINER_PROGRESS_EVERY_S"]))
    except (KeyError, ValueError):
        return EVERY_S


class Progress:
    """`tick(done)` prints `<what>: <done>[/<total>] <unit> (<rate>/s, ETA m:ss)` when EVERY_S have
    passed since the last line (the first line comes EVERY_S after the start: a short wait prints
    nothing). `enabled` False: silent (ranks other than 0). `every_s` None: default_every_s()."""

    def __init__(self, what: str, total: int | None = None, unit: str = "", enabled: bool = True,
                 every_s: float | None = None, stream=None, clock=time.monotonic):
        every_s = default_every_s() if every_s is None else every_s
        self.what, self.total, self.unit, self.enabled, self.every_s = what, total, unit, enabled, every_s
        self.stream, self.clock = stream, clock
        self.started = self.last = clock()

    def restart(self) -> None:
        """The wait begins now (after a set-up that is not part of it: an import, say)."""
        self.started = self.last = self.clock()

    def tick(self, done: int) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now - self.last < self.every_s:
            return
        self.last = now
        print(self.line(done, now - self.started), file=self.stream or sys.stdout, flush=True)

    def line(self, done: int, seconds: float) -> str:
        rate = done / seconds if seconds > 0 else 0.0
        counted = f"{done:,}" + (f"/{self.total:,}" if self.total else "") + (f" {self.unit}" if self.unit else "")
        pace = f"{rate:,.1f}/s" if rate < 100 else f"{rate:,.0f}/s"
        if self.total and rate > 0:
            pace += f", ETA {clock_time((self.total - done) / rate)}"
        return f"{self.what}: {counted} ({pace})"


def clock_time(seconds: float) -> str:
    """h:mm:ss, or m:ss under an hour."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"
