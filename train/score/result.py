"""What scoring a run, or a published result, gives (train/score/runs.py makes it; the table, the
JSON, the picture and the MLPerf score read it)."""
from dataclasses import dataclass, field


class ScoreError(Exception):
    """Nothing could be scored; the message says why."""


@dataclass
class Score:
    run: str
    time_to_quality_s: float
    images: int
    throughput_img_s: float
    top1: float
    total_flop: float
    flops: float
    valid_flops: float
    mlperf_compliant: bool | None = None
    mlperf_verdict: str = ""
    mlperf_reason: str = ""  # why the checker gave no verdict (mlperf_compliant null); "" when it did
    time_to_target_s: float | None = None
    reached_target: bool | None = None
    training_time_s: float | None = None
    wall_time_s: float | None = None
    status: str = "complete"
    hpc_ai500_level: str = ""
    level_reason: str = ""
    config_key: str = ""
    notes: list = field(default_factory=list)
