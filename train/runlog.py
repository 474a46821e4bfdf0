"""What a run leaves behind and prints: mllog.txt (MLLOG lines via mlperf_logging), metrics.jsonl
(one JSON object per logging point) and human lines on stdout. Only rank 0 writes."""
import json
import logging
import sys
import time
from pathlib import Path

from mlperf_logging.mllog.mllog import MLLogger


class RunLog:
    def __init__(self, out_dir: Path | None):
        """out_dir None: a silent log (ranks other than 0)."""
        self.enabled = out_dir is not None
        self.mllog = None
        if not self.enabled:
            return
        logger = logging.getLogger(f"trainer.mllog.{id(self)}")
        logger.propagate = False
        logger.setLevel(logging.INFO)
        self._handler = logging.FileHandler(out_dir / "mllog.txt")
        logger.addHandler(self._handler)
        # stack offset 2: the call site reported in the metadata is the trainer's line, not this wrapper's
        self.mllog = MLLogger(logger=logger, default_stack_offset=2)
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


def progress(iterable, total: int, enabled: bool, desc: str):
    """A tqdm bar on an interactive terminal; the plain iterable in files and CI."""
    if not enabled or not sys.stderr.isatty():
        return iterable
    from tqdm import tqdm
    return tqdm(iterable, total=total, desc=desc, leave=False, dynamic_ncols=True)
