"""A trainer killed with SIGKILL (no handler runs, no finaliser) leaves no process behind: its helpers,
DALI's reader processes, the multiprocessing resource tracker they share and the checkpoint writer,
end by themselves once it is gone. (The torch loader decodes on threads: it starts no process.)"""
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from helpers import descendants, kill_tree, start, wait_until

GONE_WITHIN_S = 5


def stat(pid: int) -> tuple[str, int, str] | None:
    """(state, session, start time) of a process, None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[3]), fields[19]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int, started: str) -> bool:
    """The same process (not a later one with its pid), not a zombie."""
    now = stat(pid)
    return now is not None and now[0] != "Z" and now[2] == started


def left_alive(processes: dict[int, str], within_s: float = GONE_WITHIN_S) -> list[int]:
    """Those of `processes` ({pid: start time}) still alive after waiting up to `within_s` for them to end."""
    deadline = time.time() + within_s
    while time.time() < deadline and any(alive(pid, started) for pid, started in processes.items()):
        time.sleep(0.1)
    return [pid for pid, started in processes.items() if alive(pid, started)]


def in_session(session: int) -> dict[int, str]:
    """Live processes of a session, with their start times: any the run started after the snapshot."""
    found = {}
    for entry in Path("/proc").iterdir():
        now = stat(int(entry.name)) if entry.name.isdigit() else None
        if now is not None and now[0] != "Z" and now[1] == session:
            found[int(entry.name)] = now[2]
    return found


@pytest.mark.slow
def test_a_killed_dali_run_leaves_no_process_behind(tmp_path):
    run = tmp_path / "run"
    proc = start([sys.executable, "-m", "train", "--loader", "dali", "--out-dir", run, "--arch", "resnet18",
                  "--epochs", 60, "--workers", 1, "--log-every", 1], cwd=tmp_path, log=tmp_path / "log")
    helpers: dict[int, str] = {}
    try:
        def training_with_helpers():
            """{pid: start time} of the run's descendants, once they include DALI's readers and the
            checkpoint writer (started by the first epoch's checkpoint) and the run is in an epoch."""
            metrics = run / "metrics.jsonl"
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            found = {pid: stat(pid) for pid in descendants(proc.pid)}
            names = " ".join(cmdline(pid) for pid in found)
            started = lines and '"kind": "train"' in lines[-1] and "spawn_main" in names and "checkpoint_writer" in names
            return started and {pid: s[2] for pid, s in found.items() if s is not None}
        helpers = wait_until(training_with_helpers, 180, "training with DALI's readers and the checkpoint writer",
                             alive=[proc])
        os.kill(proc.pid, signal.SIGKILL)  # mid-epoch (15 steps an epoch, each logged)
        proc.wait()
        helpers.update(in_session(proc.pid))
        left = left_alive(helpers)
        assert not left, f"alive {GONE_WITHIN_S} s after the trainer's SIGKILL: {[cmdline(pid) for pid in left]}"
    finally:
        end_all(proc, helpers)


def end_all(proc, helpers: dict[int, str]) -> None:
    """SIGKILL whatever of the run is left, the resource tracker last: left to end by itself once the
    others are gone, it unlinks the semaphores they registered (killed, it leaves them in /dev/shm)."""
    left = {**helpers, **in_session(proc.pid)}
    for pid, started in left.items():
        if alive(pid, started) and "resource_tracker" not in cmdline(pid):
            os.kill(pid, signal.SIGKILL)
    for pid in left_alive(left):
        os.kill(pid, signal.SIGKILL)
    kill_tree(proc)  # and reaped
