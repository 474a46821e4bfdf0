"""Run under torchrun with 2 processes (argv: OUT_DIR): ghost BatchNorm (groups of G = 2 of each
rank's 4 images) over a BN span of 2 ranks, through engine.sync_batchnorm, against plain
BatchNorm2d in one process over the concatenation of group i of both ranks (every rank can make
every rank's data, so the reference needs no communication). Writes OUT_DIR/rank<r>.json: the
largest differences of the outputs, the input gradients (loss summed over both ranks) and the running
statistics, how far the ghost groups of this rank alone (no span) are from the reference, and whether
span 1 without ghost groups left a model untouched."""
import json
import sys
from pathlib import Path

import torch

from train.config import Config
from train.engines import create

N, G, C = 4, 2, 3


def data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + rank)
    images = torch.randn(N, C, 5, 5, generator=generator) * (1 + rank) + rank  # ranks differ in scale and shift
    return images.contiguous(memory_format=torch.channels_last), torch.randn(N, C, 5, 5, generator=generator)


def plain_bn() -> torch.nn.BatchNorm2d:
    bn = torch.nn.BatchNorm2d(C)
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.5, 1.0, 1.5]))
        bn.bias.copy_(torch.tensor([-0.2, 0.0, 0.3]))
    return bn


def run(module: torch.nn.Module, images: torch.Tensor, weights: torch.Tensor):
    x = images.clone().requires_grad_()
    out = module(x)
    (out * weights).sum().backward()
    return out.detach(), x.grad


def reference(rank: int):
    """Plain BN over group i of rank 0 followed by group i of rank 1, one pass per group; the running
    statistics averaged over the groups' passes (GroupBatchNorm2d's documented update)."""
    (x0, w0), (x1, w1) = data(0), data(1)
    outs, grads, means, variances = [], [], [], []
    for i in range(N // G):
        rows = slice(i * G, (i + 1) * G)
        bn = plain_bn()
        out, grad = run(bn, torch.cat([x0[rows], x1[rows]]), torch.cat([w0[rows], w1[rows]]))
        outs.append(out[rank * G:(rank + 1) * G])
        grads.append(grad[rank * G:(rank + 1) * G])
        means.append(bn.running_mean)
        variances.append(bn.running_var)
    return torch.cat(outs), torch.cat(grads), torch.stack(means).mean(0), torch.stack(variances).mean(0)


def main():
    out_dir = Path(sys.argv[1])
    engine = create(Config(engine="torch"))
    images, weights = data(engine.rank)
    ghost = engine.sync_batchnorm(torch.nn.Sequential(plain_bn()), 2, G)
    out, grad = run(ghost, images, weights)
    ref_out, ref_grad, ref_mean, ref_var = reference(engine.rank)
    alone = engine.sync_batchnorm(torch.nn.Sequential(plain_bn()), 1, G)  # this rank's groups only
    alone_out, _ = run(alone, images, weights)
    plain = torch.nn.Sequential(plain_bn())
    untouched = engine.sync_batchnorm(plain, 1, 0) is plain and type(plain[0]) is torch.nn.BatchNorm2d
    result = {"rank": engine.rank, "converted": type(ghost[0]).__name__, "span_1_untouched": untouched,
              "output": (out - ref_out).abs().max().item(), "input_grad": (grad - ref_grad).abs().max().item(),
              "running_mean": (ghost[0].running_mean - ref_mean).abs().max().item(),
              "running_var": (ghost[0].running_var - ref_var).abs().max().item(),
              "without_span": (alone_out - ref_out).abs().max().item(),
              "channels_last": out.is_contiguous(memory_format=torch.channels_last)}
    (out_dir / f"rank{engine.rank}.json").write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    main()
