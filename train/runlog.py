"""What a run leaves behind and prints: mllog.txt (MLLOG lines via mlperf_logging), metrics.jsonl
(one JSON object per logging point) and human lines on stdout. Only rank 0 writes."""
import json
import logging
import sys
import time
from pathlib import Path

from mlperf_logging.mllog.mllog import MLLogger


class RunLog:
    """`seconds` in metrics.jsonl is training time: it runs from the first segment's run_start and
    goes on from where the last segment stopped when a run is resumed (downtime excluded); a
    `resume` record marks each new segment with the wall-clock gap."""

    def __init__(self, out_dir: Path | None):
        """out_dir None: a silent log (ranks other than 0)."""
        self.enabled = out_dir is not None
        self.mllog = None
        self._started, self._offset, self._last_record = time.time(), 0.0, None
        if not self.enabled:
            return
        logger = logging.getLogger(f"trainer.mllog.{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        self._handler = logging.FileHandler(out_dir / "mllog.txt")
        logger.addHandler(self._handler)
        # stack offset 2: the call site reported in the metadata is the trainer's line, not this wrapper's
        self.mllog = MLLogger(logger=logger, default_stack_offset=2)
        self._last_record = _last_record(out_dir / "metrics.jsonl")
        self._metrics = open(out_dir / "metrics.jsonl", "a", buffering=1)

    def event(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self.mllog.event(key=key, value=value, metadata=metadata or None)

    def start(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self.mllog.start(key=key, value=value, metadata=metadata or None)

    def end(self, key: str, value=None, **metadata) -> None:
        if self.enabled:
            self.mllog.end(key=key, value=value, metadata=metadata or None)

    def start_clock(self, resumed_at: dict | None = None) -> None:
        """Starts the run's clock at run_start; `resumed_at` ({step, epoch}) marks a resumed segment."""
        self._started = time.time()
        last = self._last_record or {}
        self._offset = float(last.get("seconds", 0.0)) if resumed_at else 0.0
        if resumed_at and self.enabled:
            gap = round(self._started - last["time"], 3) if "time" in last else None
            self.metrics(kind="resume", **resumed_at, seconds=round(self._offset, 3), gap_s=gap)

    def seconds(self) -> float:
        """Training seconds since the run's first start, downtime between segments excluded."""
        return round(self._offset + time.time() - self._started, 3)

    def metrics(self, **record) -> None:
        if self.enabled:
            record["time"] = round(time.time(), 3)
            self._metrics.write(json.dumps(record) + "\n")

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self.enabled:
            self._metrics.close()
            self._handler.close()


def _last_record(path: Path) -> dict | None:
    """The last complete JSON line of metrics.jsonl, if the file exists (a resumed run's)."""
    if not path.is_file():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:  # a line cut off by a crash
            continue
    return None


def progress(iterable, total: int, enabled: bool, desc: str):
    """A tqdm bar on an interactive terminal; the plain iterable in files and CI."""
    if not enabled or not sys.stderr.isatty():
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
