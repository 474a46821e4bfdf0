"""--fp16-allreduce: what the gradient all-reduce sends, and how the average keeps the sum in range
(docs/allreduce.md, "The compressed all-reduce").

The wire type is the run's own half type where the engine can send it: a bf16 run sends bf16 (fp32's
range: nothing a bf16 run keeps is lost), an fp16 or fp32 run sends fp16. Horovod 0.28.1 refuses bf16
tensors, so under Horovod a bf16 run sends its gradients as they are, fp32: fp16 would flush the small
gradients that a bf16 run keeps without loss scaling (below 6e-8 they become zero).

The average over p ranks is split around the sum: every rank multiplies its gradients by 2^-k on the
way into the wire type and the sum is divided by p / 2^k once it is back in the gradients' type, with
k = floor(log2(p) / 2). 2^-k is a power of two, exact; the sum is at most p / 2^k (about sqrt(p))
times the largest gradient, and a small gradient loses k bits, half of what a division by p before the
sum costs. Dividing after the sum alone overflows fp16 (4 ranks x 3e4 > 65504), dividing before it alone
makes 1e-4 subnormal at 2528 ranks. Both numbers are the same Python floats on every rank: no host
read, no extra collective.
"""
from typing import NamedTuple

import torch

from train.precision import resolve


class Wire(NamedTuple):
    dtype: torch.dtype | None  # the gradients' type on the wire; None: their own (no compression)
    note: str | None  # one line for the run's output where the flag does not do what it says


NOT_ON_ONE_PROCESS = "--fp16-allreduce does nothing on one process: there are no gradients to exchange"


def choose(cfg, device: torch.device, sends_bf16: bool) -> Wire:
    """The wire of a distributed engine's gradient all-reduce, from --fp16-allreduce and the run's
    resolved precision; `sends_bf16`: whether the engine can send bf16 tensors."""
    if not cfg.fp16_allreduce:
        return Wire(None, None)
    if resolve(cfg.precision, device) != "bf16":
        return Wire(torch.float16, None)
    if sends_bf16:
        return Wire(torch.bfloat16, "--fp16-allreduce: gradients travel as bf16, this bf16 run's own half type "
                                    "(fp16 would flush its small gradients to zero)")
    return Wire(None, "--fp16-allreduce: gradients travel as fp32 in this bf16 run (Horovod cannot send bf16, "
                      "and fp16 would flush its small gradients to zero)")


def split_average(world_size: int) -> tuple[float, float]:
    """(factor before the sum, divisor after it) of the average over `world_size` ranks: 2^-k and
    world_size / 2^k, k = floor(log2(world_size) / 2). Both are exact in fp32 (up to 2^24 ranks)."""
    k = (world_size.bit_length() - 1) // 2  # floor(log2(p) / 2) = floor(floor(log2 p) / 2)
    return 2.0 ** -k, world_size / 2 ** k


def into_wire(gradients: torch.Tensor, factor: float, wire: torch.Tensor) -> None:
    """gradients x factor, computed in the gradients' type and rounded once into `wire` (its type)."""
    torch.mul(gradients, factor, out=wire)
