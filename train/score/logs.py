"""Reading a run directory: mllog.txt (the MLPerf log), metrics.jsonl (the trainer's records) and
config.yaml; and the trainer's training-time clock, which leaves out the downtime of resumes."""
import json
from pathlib import Path

from train.rundir import RunDir


def read_mllog(path: Path, notes: list) -> list[dict]:
    """The `:::MLLOG` events of path in file order; a cut-off line is skipped and noted."""
    events = []
    for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        if not line.startswith(":::MLLOG "):
            continue
        try:
            events.append(json.loads(line[len(":::MLLOG "):]))
        except json.JSONDecodeError:
            notes.append(f"line {number} of {path.name} is cut off; ignored")
    return events


def read_metrics(run_dir: Path, notes: list) -> list[dict]:
    """The records of run_dir/metrics.jsonl in file order; none when it is missing."""
    metrics, path = [], RunDir(run_dir).metrics
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                metrics.append(json.loads(line))
            except json.JSONDecodeError:
                notes.append(f"a line of {path.name} is cut off; ignored")
    return metrics


def read_config(run_dir: Path) -> dict:
    """The run's settings from run_dir/config.yaml (old keys renamed); none when it is missing."""
    saved = RunDir(run_dir)
    return saved.saved_settings() if saved.holds_config() else {}


def training_seconds(time_ms: float, run_start_ms: float, resumes: list[dict]) -> float:
    """Seconds from the first run_start to time_ms, less the downtime of the resumes before it: the
    trainer's own `seconds` clock."""
    downtime = sum(r.get("gap_s") or 0 for r in resumes if r["time"] * 1000 <= time_ms)
    return (time_ms - run_start_ms) / 1000 - downtime
