"""Progress of long waits (data/progress.py) and of a run wherever its output goes."""
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios

from data.progress import Progress, clock_time
from helpers import child_env


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
    counting.restart()  # the wait begins again: its rate and its next line count from now
    clock.now += 4
    counting.tick(400)
    clock.now += 1
    counting.tick(500)
    assert out.getvalue().splitlines()[1:] == ["indexing train: 500 files (100/s)"]
    assert (clock_time(59.6), clock_time(3725)) == ("1:00", "1:02:05")


def test_the_period_comes_from_trainer_progress_every_s_unless_given(monkeypatch):
    monkeypatch.setenv("TRAINER_PROGRESS_EVERY_S", "0")
    assert Progress("waiting").every_s == 0 and Progress("waiting", every_s=7).every_s == 7
    monkeypatch.setenv("TRAINER_PROGRESS_EVERY_S", "soon")
    assert Progress("waiting").every_s == 5
    monkeypatch.delenv("TRAINER_PROGRESS_EVERY_S")
    assert Progress("waiting").every_s == 5


RUN = ["-m", "train", "--out-dir", "run", "--loader", "synthetic", "--arch", "resnet18", "--image-size", "32",
       "--synthetic-images", "128", "--synthetic-val-images", "64", "--synthetic-classes", "10",
       "--global-batch-size", "16", "--epochs", "2", "--log-every", "2", "--eval-every", "1", "--batch-size", "16"]


def test_a_run_with_stdout_to_a_file_prints_a_progress_line_every_log_every_steps(tmp_path):
    """Each line says the epoch, the step of the epoch's steps, images/s, loss, LR and the epoch's ETA,
    and comes before the epoch's own line; an evaluation says how many of its batches are done."""
    with open(tmp_path / "out.txt", "w") as out:
        done = subprocess.run([sys.executable, *RUN], cwd=tmp_path, stdout=out, stderr=subprocess.PIPE, text=True,
                              timeout=600, env=child_env(TRAINER_PROGRESS_EVERY_S="0"))
    assert done.returncode == 0, done.stderr
    lines = (tmp_path / "out.txt").read_text().splitlines()
    shown = [(int(m[1]), int(m[2])) for m in (PROGRESS.match(line) for line in lines) if m]
    assert shown == [(epoch, step) for epoch in (1, 2) for step in (2, 4, 6, 8)], lines
    assert lines.index(next(line for line in lines if line.startswith("epoch   1/2"))) == \
        lines.index(next(line for line in lines if PROGRESS.match(line) and " 8/8 " in line)) + 1
    assert any(re.fullmatch(r"evaluating: [1-4]/4 batches \(.*/s, ETA \d+:\d\d\)", line) for line in lines), lines


PROGRESS = re.compile(r"train +(\d)/2  step +(\d)/8 +[\d.]+ img/s  loss [\d.]+  lr [\d.e+-]+  ETA 0:\d\d")


def test_on_a_terminal_a_bar_counts_images_per_second_instead_of_lines(tmp_path):
    main, other = pty.openpty()
    fcntl.ioctl(other, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # (a terminal 0 columns wide shows no bar)
    proc = subprocess.Popen([sys.executable, *RUN], cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=other, stderr=other,
                            env=child_env())
    os.close(other)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 1 << 16)
        except OSError:  # the terminal's other end closed: the run has ended
            break
        if not chunk:
            break
        seen += chunk
    os.close(main)
    assert proc.wait(timeout=60) == 0, seen.decode(errors="replace")[-2000:]
    text = seen.decode(errors="replace")
    assert re.search(r"epoch 1: .*\d+/128 \[.*img/s\]", text), text[-2000:]
    assert "done: 16 steps" in text and not any(PROGRESS.match(line) for line in text.splitlines())
