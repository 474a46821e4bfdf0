"""--compile: the model compiled in place by torch.compile, one graph for each input shape the run
makes, and no more graphs than those (docs/compile.md).

A compiled graph holds for one input shape. A run makes a few: one per training crop size and
per-rank batch (progressive resizing, batch-size control), one for the evaluation (its batches all
of one shape), one for BatchNorm's recomputation (training mode, under hooks). Each is compiled once,
static: kernels for that shape, where torch's automatic dynamic shapes would compile the second
shape again with the sizes as variables, and CUDA graphs (--compile-mode reduce-overhead) record one
graph per shape either way. Dynamo compiles at most `recompile_limit` graphs of a function, 8 unless
raised: raised to the run's shape count when it makes more, so a long ramp compiles every one of its
sizes, and a shape the count did not foresee past the limit runs eagerly (torch says so once) instead
of compiling again.
"""
import torch

from train.batches import epoch_split

GRAPH_MODES = ("reduce-overhead", "max-autotune")  # torch.compile's modes that replay CUDA graphs


def run_shapes(cfg, plan, world_size: int) -> int:
    """How many input shapes the model meets in a run of these settings and per-epoch plan (the module
    docstring lists them)."""
    # (the per-rank batch of a pass: the global batch over the ranks and the epoch's accumulation steps)
    training = {(plan.image_size(epoch), plan.global_batch(epoch) // (world_size * epoch_split(cfg, epoch)[2]))
                for epoch in range(cfg.epochs)}
    return len(training) + bool(cfg.eval_every) + bool(cfg.bn_recompute_batches)


def compile_in_place(model: torch.nn.Module, mode: str, shapes: int, backend="inductor") -> None:
    """`model.compile()` with static shapes, for a run of `shapes` input shapes (run_shapes); in place,
    the model keeps its class and state_dict keys. `backend`: torch.compile's (tests take a cheap one)."""
    import torch._dynamo
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # (its older name)
    setattr(config, limit, max(getattr(config, limit), shapes))
    model.compile(mode=mode, dynamic=False, backend=backend)
