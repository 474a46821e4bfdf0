"""What the planner knows about the hardware: GPUs, links inside a node, networks between nodes.

Every figure is a data-sheet rate or a stated assumption; docs/planner.md gives each one's source.
Rates are per direction. Links reach `LINK_EFFICIENCY` of their line rate (an assumption: what
all-reduce benchmarks typically get out of a link), and every message hop pays its link's latency.
A custom network (`--network custom`) is given by the rate it delivers, so it gets no such factor.
"""
import math
from dataclasses import dataclass

from train.errors import UsageError

LINK_EFFICIENCY = 0.8  # share of a link's line rate a collective gets (assumed)
MEMORY_EFFICIENCY = 0.8  # share of HBM bandwidth an elementwise optimizer kernel gets (assumed)
GB = 1e9


@dataclass(frozen=True)
class Gpu:
    name: str
    hbm_bytes_per_s: float  # memory bandwidth: the optimizer step is bound by it
    nvlink_bytes_per_s: float  # one GPU's NVLink bandwidth to its node's peers, per direction
    pcie_bytes_per_s: float  # its PCIe slot, per direction (a node without NVLink)
    precision: str  # what its calibration figures were measured in
    node: tuple[int, str, int]  # default node: GPUs per node, network, links per node
    memory_bytes: float  # the model whose figures calibrate it: V100-16GB, A100-80GB, H100 80 GB, H200 141 GB


GPUS = {
    "v100": Gpu("v100", 900 * GB, 150 * GB, 16 * GB, "fp16 (mixed)", (8, "ib-edr", 4), 16 * GB),  # DGX-1
    "a100": Gpu("a100", 2039 * GB, 300 * GB, 32 * GB, "fp16 (mixed)", (8, "ib-hdr", 8), 80 * GB),  # DGX A100
    "h100": Gpu("h100", 3350 * GB, 450 * GB, 64 * GB, "fp16 (mixed)", (8, "ib-ndr", 8), 80 * GB),  # DGX H100
    "h200": Gpu("h200", 4800 * GB, 450 * GB, 64 * GB, "fp16 (mixed)", (8, "ib-ndr", 8), 141 * GB),  # DGX H200
}
NOT_MODELLED = "P100, P40 and TPUs are not modelled: no calibration figures for them"


@dataclass(frozen=True)
class Link:
    """What one message hop costs: a fixed latency, then bytes at a rate."""
    latency_s: float
    bytes_per_s: float

    def time(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s


# Between nodes, per link (one adapter): line rate, and the latency of one hop through the switch.
NETWORKS = {
    "ib-edr": (100e9 / 8, 5e-6),  # InfiniBand EDR, 100 Gb/s
    "ib-hdr": (200e9 / 8, 5e-6),  # HDR, 200 Gb/s
    "ib-ndr": (400e9 / 8, 5e-6),  # NDR, 400 Gb/s
    "eth-100g": (100e9 / 8, 20e-6),  # 100 Gb Ethernet (RoCE or TCP): the same rate, a slower hop
}
CUSTOM = "custom"  # --network custom: a link given by --link-gbps and --latency-us
IN_NODE_LATENCY_S = {"nvlink": 3e-6, "pcie": 5e-6}


@dataclass(frozen=True)
class CustomNetwork:
    """A network between nodes given by what one link delivers (a measured or shaped link, e.g.
    scripts/cluster.sh's): Gbit/s per direction and the one-way latency of one hop."""
    gbps: float
    latency_us: float

    def __post_init__(self):
        for flag, value, unit in (("--link-gbps", self.gbps, "Gbit/s, e.g. 0.15 for 150 Mbit/s"),
                                  ("--latency-us", self.latency_us, "microseconds, e.g. 50")):
            if not (math.isfinite(value) and value > 0):
                raise UsageError(f"{flag} must be a positive finite number ({unit}), got {value:g}")

    def __str__(self):  # how the header names it: "custom 0.15 Gbit/s, 50 us"
        return f"{CUSTOM} {self.gbps:g} Gbit/s, {self.latency_us:g} us"


def gpu(name: str) -> Gpu:
    if name.lower() not in GPUS:
        raise UsageError(f"unknown --gpu {name!r}; known: {', '.join(GPUS)} ({NOT_MODELLED})")
    return GPUS[name.lower()]


def network_link(network: str | CustomNetwork, links_per_node: int) -> Link:
    """All of a node's links to the network together: a named network's, or a custom one's."""
    if not isinstance(network, CustomNetwork) and network not in NETWORKS:
        raise UsageError(f"unknown --network {network!r}; known: {', '.join(NETWORKS)}, {CUSTOM} (with --link-gbps "
                         "and --latency-us)")
    if links_per_node < 1:
        raise UsageError(f"--links-per-node must be at least 1, got {links_per_node}")
    if isinstance(network, CustomNetwork):  # its rate is what the link delivers: no efficiency factor on top
        return Link(network.latency_us * 1e-6, links_per_node * network.gbps * 1e9 / 8)
    rate, latency = NETWORKS[network]
    return Link(latency, links_per_node * rate * LINK_EFFICIENCY)


def in_node_link(spec: Gpu, kind: str) -> Link:
    """One GPU's link to the other GPUs of its node."""
    if kind not in IN_NODE_LATENCY_S:
        raise UsageError(f"unknown --in-node {kind!r}; known: {', '.join(IN_NODE_LATENCY_S)}")
    rate = spec.nvlink_bytes_per_s if kind == "nvlink" else spec.pcie_bytes_per_s
    return Link(IN_NODE_LATENCY_S[kind], rate * LINK_EFFICIENCY)
