"""Progress of long waits (data/progress.py) and of a run wherever its output goes."""
import io

from data.progress import Progress, clock_time


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_wait_prints_at_most_once_every_few_seconds_with_its_rate_and_eta():
    clock, out = Clock(), io.StringIO()
    progress = Progress("writing shards", total=1000, unit="files", every_s=5, stream=out, clock=clock)
    for second, done in ((1, 10), (4.9, 49), (5, 50), (7, 70), (10.5, 105), (12, 120)):
        clock.now = 100 + second
        progress.tick(done)
    assert out.getvalue().splitlines() == ["writing shards: 50/1,000 files (10.0/s, ETA 1:35)",
                                           "writing shards: 105/1,000 files (10.0/s, ETA 1:30)"]


def test_a_wait_without_a_total_counts_and_a_silent_one_prints_nothing():
    clock, out = Clock(), io.StringIO()
    counting = Progress("indexing train", unit="files", every_s=5, stream=out, clock=clock)
    silent = Progress("indexing train", unit="files", every_s=5, stream=out, clock=clock, enabled=False)
    clock.now += 6
    counting.tick(12345)
    silent.tick(12345)
    assert out.getvalue() == "indexing train: 12,345 files (2,058/s)\n"
    assert (clock_time(59.6), clock_time(3725)) == ("1:00", "1:02:05")
