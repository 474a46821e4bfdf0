"""The arithmetic of where the ranks are: the grid and routes of the two-level all-reduces,
hierarchical and torus (docs/allreduce.md), the BatchNorm span's check, the nodes from host names.
Pure arithmetic on rank numbers: the distributed engines (train/engines/distributed.py) run these
routes, and the planner (train/plan/comm.py) counts the same ones.
"""
from train.errors import UsageError


def torus_grid(world_size: int, rows: int) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The ranks as a grid: lines of `rows` consecutive ranks, and columns of the ranks at the same
    position in each line. With rows = ranks per node, lines are nodes and columns join the ranks
    with the same local rank."""
    lines = [tuple(range(start, start + rows)) for start in range(0, world_size, rows)]
    columns = [tuple(range(position, world_size, rows)) for position in range(rows)]
    return lines, columns


def two_level_routes(allreduce: str, rank: int, world_size: int, rows: int) -> list[tuple[tuple, tuple]]:
    """This rank's routes, one per part of each gradient bucket: (scatter ranks, reduce ranks) =
    reduce-scatter among the scatter ranks, all-reduce of each shard among the reduce ranks, all-gather
    among the scatter ranks. hierarchical: the whole bucket rows-first (lines are nodes). torus: the
    first half rows-first, the second half columns-first, so that both directions carry traffic at once."""
    lines, columns = torus_grid(world_size, rows)
    line, column = lines[rank // rows], columns[rank % rows]
    if allreduce == "torus":
        return [(line, column), (column, line)]
    return [(line, column)]


def check_bn_span(span: int, world_size: int) -> None:
    if span < 1 or world_size % span:
        raise UsageError(f"--bn-span {span} does not divide the {world_size} rank(s) of this launch; "
                         "choose a divisor of the rank count (1 on one process)")


def node_summary(hosts: list[str]) -> tuple[str, dict]:
    """The nodes, from the ranks' host names (one per rank, in rank order): for the header ('2 node(s) x
    2 rank(s): ', uneven '2 node(s) (3+1 ranks): ') and the topology record ({nodes, ranks_per_node},
    0 and ranks_on_nodes when uneven)."""
    counts: dict[str, int] = {}
    for host in hosts:
        counts[host] = counts.get(host, 0) + 1
    ranks = list(counts.values())
    if len(set(ranks)) == 1:
        return f"{len(counts)} node(s) x {ranks[0]} rank(s): ", {"nodes": len(counts), "ranks_per_node": ranks[0]}
    return (f"{len(counts)} node(s) ({'+'.join(map(str, ranks))} ranks): ",
            {"nodes": len(counts), "ranks_per_node": 0, "ranks_on_nodes": ranks})
