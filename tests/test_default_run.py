"""The README's first command: `python -m train` with no flags trains and learns the embedded data."""
import re

import pytest

from helpers import compliance, read_metrics, run_train


@pytest.mark.slow(seconds=120)  # the first file started: the longest single test
def test_default_run_learns_the_embedded_dataset(tmp_path):
    result = run_train(cwd=tmp_path, timeout=900, fresh=True)  # the README's command, from its start
    assert result.returncode == 0, result.stderr
    run_dirs = list((tmp_path / "runs").iterdir())
    assert len(run_dirs) == 1 and run_dirs[0].name.startswith("smoke-")
    run_dir = run_dirs[0]
    epochs = re.findall(r"^epoch\s+(\d+)/16 .* ([\d.]+) img/s", result.stdout, re.M)
    assert [int(e) for e, _ in epochs] == list(range(1, 17)) and all(float(r) > 0 for _, r in epochs)
    evals = [m for m in read_metrics(run_dir) if m["kind"] == "eval"]
    assert len(evals) == 16 and all(e["eval_images"] == 300 for e in evals)
    assert evals[-1]["top1"] >= 0.80, evals[-1]
    assert evals[0]["top1"] < evals[-1]["top1"]  # it learned during the run
    checked = compliance(run_dir / "mllog.txt", tmp_path)
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout + checked.stderr
