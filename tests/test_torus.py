"""The engines' wrap(): --allreduce torus (a grid of lines and columns, half of each bucket along each
direction at once) against flat and hierarchical on both engines with the real launchers, and
--init-from-seed (every rank's own model, checked instead of broadcast)."""
import json

import pytest
import torch

from helpers import REPO, launch
from train.engines import topology
from train.engines.distributed import DistributedEngine
from train.config import Config
from train.errors import UsageError

pytestmark = pytest.mark.multiprocess


def test_the_grid_has_lines_of_consecutive_ranks_and_columns_across_them():
    assert topology.torus_grid(4, 2) == ([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    assert topology.torus_grid(6, 2) == ([(0, 1), (2, 3), (4, 5)], [(0, 2, 4), (1, 3, 5)])
    assert topology.torus_grid(6, 3) == ([(0, 1, 2), (3, 4, 5)], [(0, 3), (1, 4), (2, 5)])


def test_torus_sends_the_halves_along_opposite_directions_hierarchical_one_way():
    # (reduce-scatter and all-gather ranks, all-reduce ranks) per part of a bucket
    assert topology.two_level_routes("torus", 0, 4, 2) == [((0, 1), (0, 2)), ((0, 2), (0, 1))]
    assert topology.two_level_routes("torus", 3, 6, 2) == [((2, 3), (1, 3, 5)), ((1, 3, 5), (2, 3))]
    assert topology.two_level_routes("torus", 4, 6, 3) == [((3, 4, 5), (1, 4)), ((1, 4), (3, 4, 5))]
    assert topology.two_level_routes("hierarchical", 3, 6, 2) == [((2, 3), (1, 3, 5))]


def test_torus_rows_that_do_not_divide_the_ranks_are_refused_in_one_line():
    grid = DistributedEngine()
    grid.rank, grid.world_size, grid.device = 0, 6, torch.device("cpu")
    with pytest.raises(UsageError, match=r"^--torus-rows 4 does not divide the 6 ranks") as caught:
        grid._layout(Config(allreduce="torus", torus_rows=4, ranks_per_node=2), ["host"] * 6)
    assert "\n" not in str(caught.value)


def expected_events(first: str, line: list[int], column: list[int]) -> list[list]:
    """What one rank issues for one bucket, by hand: each step for both halves (first half along
    its line, second half along its column), both in flight before either is awaited."""
    wait = ["wait"]
    return [[first, line], [first, column], wait, wait,
            ["all_reduce", column], ["all_reduce", line], wait, wait,
            ["all_gather", line], ["all_gather", column], wait, wait]


# nproc, the --torus-rows values tried, and for rank 0 and the last rank: {rows: (line, column)};
# --ranks-per-node 2 throughout, so rows 2 (and 0, its default) is the hierarchical layout
GRIDS = {4: ([2, 0, 1, 4], {0: {2: ([0, 1], [0, 2])}, 3: {2: ([2, 3], [1, 3])}}),
         6: ([2, 3], {0: {2: ([0, 1], [0, 2, 4]), 3: ([0, 1, 2], [0, 3])},
                      5: {2: ([4, 5], [1, 3, 5]), 3: ([3, 4, 5], [2, 5])}})}


@pytest.mark.parametrize("nproc", [4, 6])
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_torus_equals_flat_and_hierarchical_and_takes_both_directions_at_once(engine, nproc, tmp_path):
    rows, routes = GRIDS[nproc]
    result = launch(engine, nproc, REPO / "tests" / "helpers" / "torus_check.py", engine, tmp_path,
                    ",".join(map(str, rows)), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(nproc)]
    for rank in ranks:
        assert rank["local_gap"] > 1e-2  # the average really mixes the ranks' different gradients
        assert rank["hierarchical_vs_flat"] <= 1e-5
        for r in rows:
            assert rank["torus"][str(r)]["vs_flat"] <= 1e-5, (rank["rank"], r)
        assert rank["torus"]["2"]["vs_hierarchical"] <= 1e-5  # rows = ranks per node
        # every path's average is the exact mean but for the rounding of its sums
        assert len(rank["rounding_units"]) == 2 + len(rows)
        for path, units in rank["rounding_units"].items():
            assert units <= 1, (rank["rank"], path, units)
        if nproc == 4:
            # in float64 a few LARS steps of resnet18 agree to float64's rounding (amplified by training,
            # as fp32's is): nothing else separates torus from flat (docs/allreduce.md, "Torus against flat")
            assert rank["float64_training_torus_vs_flat"] <= 1e-10, rank["float64_training_torus_vs_flat"]
    # the first step's reduce-scatter: on torch an all-to-all and a local sum (gloo's reduce-scatter
    # has no future to chain on), on Horovod an all-reduce (its reducescatter is unreliable on gloo)
    first = "all_to_all" if engine == "torch" else "all_reduce"
    for r, by_rows in routes.items():
        for r_rows, (line, column) in by_rows.items():
            assert ranks[r]["torus"][str(r_rows)]["events"] == expected_events(first, line, column), (r, r_rows)


def test_torus_rows_that_do_not_divide_the_launch_stop_the_cli_with_exit_2(tmp_path):
    result = launch("torch", 2, "-m", "train", "--loader", "synthetic", "--arch", "resnet18", "--out-dir", "run",
                    "--allreduce", "torus", "--torus-rows", 3, cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: --torus-rows 3 does not divide the 2 ranks of this launch; choose a divisor of the "
                      "rank count (0: the ranks per node)"], result.stderr[-3000:]
    assert not (tmp_path / "run").exists()


# --init-from-seed -----------------------------------------------------------------------------------
