"""scripts/stress.py (docs/stress.md): a command run many times under each load, its failures counted
and grouped by how they ended. A command that fails every other run, with a line whose numbers
change from run to run, is tallied as half failures of one kind, under each load."""
import json
import subprocess
import sys

from helpers import REPO

FLAKY = """
import pathlib, sys
counter = pathlib.Path(sys.argv[1])
n = int(counter.read_text()) if counter.exists() else 0
counter.write_text(str(n + 1))
if n % 2:
    print(f"rank {n}: error: weights are not finite at step {n * 7}", file=sys.stderr)
    sys.exit(3)
"""


def test_failures_are_counted_per_load_and_grouped_by_what_they_said(tmp_path):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    out = tmp_path / "tallies.json"
    command = [sys.executable, REPO / "scripts" / "stress.py", "--runs", 4, "--hogs", "0,1", "--out", out,
               "--", sys.executable, script, tmp_path / "count"]
    done = subprocess.run(list(map(str, command)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr  # (some run failed)
    loads = json.loads(out.read_text())["loads"]
    assert [(load["hogs"], load["runs"], load["failures"]) for load in loads] == [(0, 4, 2), (1, 4, 2)]
    for load in loads:
        assert load["outcomes"] == {"ok": 2, "rank N: error: weights are not finite at step N": 2}, load
    assert (tmp_path / "count").read_text() == "8"
    assert "2x rank N: error: weights are not finite at step N" in done.stdout
