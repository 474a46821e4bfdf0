"""--init-from-seed: every rank builds the initial model from the seed, no broadcast, and a checksum
refuses ranks that built different models."""
import json

import pytest

from helpers import REPO, launch, read_metrics


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_init_from_seed_trains_two_ranks_that_end_alike(engine, tmp_path):
    result = launch(engine, 2, "-m", "train", "--loader", "synthetic", "--arch", "resnet18", "--image-size", 16,
                    "--synthetic-images", 32, "--synthetic-classes", 10, "--global-batch-size", 8, "--epochs", 1,
                    "--eval-every", 0, "--init-from-seed", "--engine", engine, "--out-dir", "run", cwd=tmp_path,
                    timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    replicas = [m for m in read_metrics(tmp_path / "run") if m["kind"] == "replicas"]
    assert replicas[-1]["ranks"] == 2 and replicas[-1]["differing_from_rank0"] == 0


@pytest.mark.multiprocess
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_init_from_seed_refuses_ranks_with_different_models_and_skips_the_broadcast(engine, tmp_path):
    result = launch(engine, 2, REPO / "tests" / "helpers" / "init_seed_check.py", engine, tmp_path, cwd=tmp_path,
                    timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:
        assert rank["same_seed_passed"]
        assert rank["error"] and rank["agreed"], rank  # raised on every rank, alike
        assert "ranks built different initial models from --seed" in rank["error"]
        assert "drop --init-from-seed" in rank["error"] and "\n" not in rank["error"]
        sums = rank["weight_sums_after_wrap"]
        assert sums["init_from_seed"][0] != sums["init_from_seed"][1]  # no broadcast: each kept its own
        assert sums["broadcast"][0] == sums["broadcast"][1] == sums["init_from_seed"][0]  # rank 0's everywhere
    assert ranks[0]["error"] == ranks[1]["error"]
