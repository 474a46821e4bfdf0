"""What one gradient all-reduce costs, for each algorithm the trainer has, plus a tree for comparison.

Every algorithm is built from ring collectives over groups of ranks. A ring over k ranks moves a
message of m bytes in rounds of m/k bytes per rank: reduce-scatter and all-gather take k-1 rounds,
all-reduce 2(k-1). A round costs its slowest hop: latency + (m/k) / bandwidth. A group whose ranks
share a node uses the GPU's in-node link; a group spanning nodes is limited by the network, whose
bandwidth (all of a node's links together) is shared by the groups that leave the node at once.

The groups are the trainer's own (train/engines/topology.py). flat is the engine's own all-reduce over all
ranks: on CPUs gloo's, one ring; on GPUs NCCL's, which picks per call the cheaper of its ring and its
tree (NCCL's tuning model, src/graph/tuning.cc; docs/planner.md), modelled by nccl_ring and
nccl_tree. hierarchical and torus are the routes of two_level_routes over the grid of torus_grid (reduce-scatter among the
scatter ranks, all-reduce of the shard among the reduce ranks, all-gather); torus sends half of the
message along each route at once. tree is hierarchical with the between-node all-reduce done by
recursive halving and doubling (Rabenseifner: 2 log2(k) latencies at a ring's bandwidth), as NCCL's
trees and SHARP give logarithmic latency; the trainer does not have it.
"""
import math
from dataclasses import dataclass

from train.plan.hardware import Link

ALGORITHMS = ("flat", "hierarchical", "torus", "tree")
ROUNDS = {"reduce_scatter": lambda k: k - 1, "all_gather": lambda k: k - 1, "all_reduce": lambda k: 2 * (k - 1)}


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    in_node: Link  # one GPU to its node's peers
    network: Link  # one node to the others: all its links together


def spans_nodes(group: tuple, gpus_per_node: int) -> bool:
    return len({rank // gpus_per_node for rank in group}) > 1


def ring(kind: str, k: int, message_bytes: float, hop: Link) -> float:
    """A ring collective over k ranks: rounds x (latency + message/k bytes)."""
    if k == 1:
        return 0.0
    return ROUNDS[kind](k) * hop.time(message_bytes / k)


def halving_doubling(k: int, message_bytes: float, hop: Link) -> float:
    """All-reduce by recursive halving then doubling: 2 log2(k) latencies, a ring's 2(k-1)/k bytes."""
    if k == 1:
        return 0.0
    return 2 * math.ceil(math.log2(k)) * hop.latency_s + 2 * (k - 1) / k * message_bytes / hop.bytes_per_s


def leaving_groups(family: list[tuple], gpus_per_node: int) -> int:
    """How many groups of a family (lines, or columns) leave node 0 at once: they share its network."""
    first_node = set(range(gpus_per_node))
    return sum(1 for group in family if first_node & set(group) and spans_nodes(group, gpus_per_node))


def hop(group: tuple, cluster: Cluster, network_sharers: int, node_sharers: int) -> Link:
    """The slowest hop of a ring over `group`, its links shared with the other groups in flight."""
    if spans_nodes(group, cluster.gpus_per_node):
        return Link(cluster.network.latency_s, cluster.network.bytes_per_s / max(1, network_sharers))
    return Link(cluster.in_node.latency_s, cluster.in_node.bytes_per_s / max(1, node_sharers))


def flat(cluster: Cluster, nbytes: float) -> float:
    """gloo's all-reduce: one ring in synchronous rounds, each as slow as the slowest hop."""
    everyone = tuple(range(cluster.gpus))
    return ring("all_reduce", cluster.gpus, nbytes, hop(everyone, cluster, 1, 1))


def nodes_in(cluster: Cluster) -> int:
    return math.ceil(cluster.gpus / cluster.gpus_per_node)


def slowest_link(cluster: Cluster) -> float:
    """Bytes/s of the slowest link a message crosses: the network once it leaves the node."""
    if nodes_in(cluster) == 1:
        return cluster.in_node.bytes_per_s
    return min(cluster.in_node.bytes_per_s, cluster.network.bytes_per_s)


def nccl_ring(cluster: Cluster, nbytes: float) -> float:
    """NCCL's ring: chunks flow through the ring in a pipeline, so each of the 2(k-1) steps pays
    its own hop's latency (2(N-1) of them cross the network, the rest stay in a node), and the
    ring's 2(k-1)/k of the message crosses the slowest link."""
    k, nodes = cluster.gpus, nodes_in(cluster)
    network_hops = 2 * (nodes - 1)
    in_node_hops = 2 * (k - 1) - network_hops
    latency = in_node_hops * cluster.in_node.latency_s + network_hops * cluster.network.latency_s
    return latency + 2 * (k - 1) / k * nbytes / slowest_link(cluster)


def nccl_tree(cluster: Cluster, nbytes: float) -> float:
    """NCCL's tree: a chain through the node's GPUs and a double binary tree over the nodes, up
    (reduce) and back down (broadcast): 2 x (G-1 in-node hops + log2(N) network hops) of latency;
    every rank sends and receives the whole message on the way up and again on the way down."""
    depth_latency = ((cluster.gpus_per_node - 1) * cluster.in_node.latency_s
                     + math.ceil(math.log2(nodes_in(cluster))) * cluster.network.latency_s)
    return 2 * depth_latency + 2 * nbytes / slowest_link(cluster)


def nccl_choice(cluster: Cluster, nbytes: float) -> tuple[str, float]:
    """(ring or tree, seconds): what NCCL's tuning picks for one all-reduce, the cheaper of the two."""
    ring_s, tree_s = nccl_ring(cluster, nbytes), nccl_tree(cluster, nbytes)
    return ("ring", ring_s) if ring_s <= tree_s else ("tree", tree_s)


def two_level(cluster: Cluster, nbytes: float, allreduce: str, rows: int) -> float:
    """hierarchical, torus or tree over a grid of lines of `rows` ranks: three steps (reduce-scatter,
    all-reduce of the shard, all-gather); in each, every part of the message travels at once, and
    the step lasts as long as its slowest part. Rank 0's routes stand for everyone's (the grid is
    regular)."""
    from train.engines.topology import torus_grid, two_level_routes  # (loads torch: --help prints without it)
    lines, columns = torus_grid(cluster.gpus, rows)
    routes = two_level_routes("torus" if allreduce == "torus" else "hierarchical", 0, cluster.gpus, rows)
    part = nbytes / len(routes)
    family = {lines[0]: lines, columns[0]: columns}

    def sharing(groups: list[tuple]) -> tuple[int, int]:
        """(groups leaving node 0, parts inside a node) of one step: who shares which link."""
        leaving = sum(leaving_groups(family[g], cluster.gpus_per_node) for g in groups
                      if spans_nodes(g, cluster.gpus_per_node))
        inside = sum(1 for g in groups if not spans_nodes(g, cluster.gpus_per_node))
        return leaving, inside

    scatter_groups, reduce_groups = [s for s, _ in routes], [r for _, r in routes]
    outer = sharing(scatter_groups)
    middle = sharing(reduce_groups)
    scatter = max(ring("reduce_scatter", len(s), part, hop(s, cluster, *outer)) for s in scatter_groups)
    gather = max(ring("all_gather", len(s), part, hop(s, cluster, *outer)) for s in scatter_groups)
    reduce = 0.0
    for s, r in routes:
        shard, link = part / len(s), hop(r, cluster, *middle)
        cost = halving_doubling(len(r), shard, link) if allreduce == "tree" else ring("all_reduce", len(r), shard, link)
        reduce = max(reduce, cost)
    return scatter + reduce + gather


def allreduce_time(cluster: Cluster, nbytes: float, allreduce: str, rows: int = 0, nccl: bool = False) -> float:
    """Seconds for one all-reduce of `nbytes` per rank. rows: the torus grid's line length (0: the
    GPUs per node; hierarchical and tree always use the nodes). nccl: flat is NCCL's all-reduce (the
    trainer on GPUs), not gloo's ring (on CPUs)."""
    if cluster.gpus == 1:
        return 0.0
    if allreduce == "flat":
        return nccl_choice(cluster, nbytes)[1] if nccl else flat(cluster, nbytes)
    node = min(cluster.gpus_per_node, cluster.gpus)
    rows = rows if allreduce == "torus" and rows else node
    return two_level(cluster, nbytes, allreduce, rows)


def exposed(comm_s: float, compute_s: float, overlap: float, backward_share: float) -> float:
    """Communication not hidden behind backward: up to `overlap` of it overlaps, and no more than
    backward lasts."""
    return comm_s - min(overlap * comm_s, backward_share * compute_s)
