"""Compute time of one training step on one GPU: a fixed cost per step plus a cost per image.

    compute(b) = fixed_s + b x per_image_s

A GPU with points at two or more per-GPU batches gets both terms by least squares. A GPU with one
point borrows the shape of the reference GPU's fit (H100, the only one published at two batches):
its fixed cost is the reference's scaled by the ratio of per-image costs, i.e. both GPUs reach half
their peak rate at the same per-GPU batch (the "knee" fixed_s / per_image_s), times a sensitivity
factor (--fixed-cost-scale, docs/planner.md).

The line keeps rising towards 1 / per_image_s beyond the largest batch it was fitted at, a rate no
one measured: a whole step is held to the fastest per-GPU rate among the GPU's points (peak_img_s).
"""
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Fit:
    gpu: str
    fixed_s: float
    per_image_s: float
    how: str  # which points, and whether the fixed cost is assumed
    peak_img_s: float = math.inf  # the fastest whole-step images/s per GPU among its points

    def seconds(self, per_gpu_batch: float) -> float:
        return self.fixed_s + per_gpu_batch * self.per_image_s

    @property
    def knee(self) -> float:
        """The per-GPU batch at which the fixed cost equals the images' cost (half the peak rate)."""
        return self.fixed_s / self.per_image_s


def affine(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed, per image) of the least-squares line through (per-GPU batch, seconds) points."""
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    spread = sum((b - mean_b) ** 2 for b, _ in points)
    if spread == 0:
        raise ValueError("an affine fit needs points at two or more per-GPU batches")
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / spread
    return mean_t - slope * mean_b, slope


def one_point(per_gpu_batch: float, seconds: float, knee: float) -> tuple[float, float]:
    """(fixed, per image) through one point, given the knee: seconds = per_image x (knee + batch)."""
    per_image = seconds / (knee + per_gpu_batch)
    return knee * per_image, per_image


def compute_from_step(step_s: float, comm_s: float, optimizer_s: float, overlap: float, backward_share: float) -> float:
    """The compute time that makes a measured step: step = compute + exposed comm + optimizer, where
    exposed = comm - min(overlap x comm, backward_share x compute) (comm.exposed) solved for compute."""
    hidden_in_full = overlap * comm_s
    compute = step_s - optimizer_s - (comm_s - hidden_in_full)
    if backward_share * compute >= hidden_in_full:
        return compute
    # backward too short to hide overlap x comm: step = compute + comm - backward_share x compute + opt
    return (step_s - optimizer_s - comm_s) / (1 - backward_share)
