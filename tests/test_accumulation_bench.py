"""scripts/bench/accumulation.py, the benchmark of a step of N accumulated batches against a plain
step: docs/bench.md names every option its --help lists, and every option has a help text."""
import re
import subprocess
import sys

from helpers import REPO, child_env


def test_accumulation_bench_options_are_documented():
    done = subprocess.run([sys.executable, REPO / "scripts" / "bench" / "accumulation.py", "--help"], cwd=REPO,
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    options = done.stdout.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", options.strip("\n"))  # (one per option: its line and the help's next lines)
    said = {}
    for entry in entries:
        first, *more = entry.splitlines()
        invocation, _, help_text = first.strip().partition("  ")
        said[invocation.split()[0].rstrip(",")] = " ".join([help_text, *more]).strip()
    said.pop("-h")
    assert {"--quick", "--report", "--accumulation-steps", "--repeats"} <= set(said), said
    assert [option for option, text in said.items() if not text] == []
    docs = (REPO / "docs" / "bench.md").read_text()
    section = docs.split("## `scripts/bench/accumulation.py`", 1)[1].split("\n## ", 1)[0]
    assert [option for option in said if option not in section] == []
