"""MLPerf Training (ruleset 4.0.0): the compliance checker's verdict on a run's log, and the score of
a set of runs (olympic mean of time to target)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from train.score.result import Score

MLPERF_TARGET = 0.759


def run_checker(mllog: Path, cwd: Path | None = None, log_output: str | None = "/dev/null") -> subprocess.CompletedProcess:
    """The real mlperf_logging compliance checker, ruleset 4.0.0, on mllog, in the division the log
    declares. It writes its own log to log_output, or to compliance_checker.log in cwd when None."""
    command = [sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", "4.0.0"]
    if log_output is not None:
        command += ["--log_output", log_output]
    return subprocess.run([*command, str(mllog)], capture_output=True, text=True, timeout=300, cwd=cwd)


def compliance(mllog: Path) -> tuple[bool, str]:
    """The checker's verdict: (True, "SUCCESS"), or False and its first warning or error."""
    result = run_checker(mllog)
    output = result.stdout + result.stderr
    if result.returncode == 0 and "SUCCESS" in output:
        return True, "SUCCESS"
    failures = [line for line in output.splitlines() if re.match(r"(WARNING|ERROR) ", line) and "FAILED" not in line]
    return False, (failures[0] if failures else output.strip().splitlines()[-1] if output.strip() else "FAILED")


def mlperf_score(scores: list[Score]) -> dict:
    """Olympic mean of time to target: drop the fastest and the slowest, mean of the rest. A run that
    never reached the target counts as the dropped slowest; two such runs make the set invalid."""
    if len({s.config_key for s in scores}) > 1:
        return {"valid": False, "reason": "the runs have different configurations; an MLPerf score needs one"}
    failed = [s for s in scores if not s.reached_target]
    if len(failed) >= 2:
        return {"valid": False, "reason": f"{len(failed)} runs never reached {MLPERF_TARGET}; at most one may fail"}
    times = sorted(s.time_to_target_s for s in scores if s.reached_target)
    kept = times[1:] if failed else times[1:-1]
    if not kept:
        return {"valid": False, "reason": "too few runs: need at least three"}
    return {"valid": True, "score_s": sum(kept) / len(kept), "runs": len(scores), "averaged": len(kept)}
