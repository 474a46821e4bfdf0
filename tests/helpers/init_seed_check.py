"""Run under a launcher with 2 processes (argv: ENGINE OUT_DIR): engine.wrap() with --init-from-seed.

1. Every rank builds the model from the same seed: wrap() passes.
2. Rank 1 builds it from another seed: wrap() raises the same UsageError on every rank, marked
   `agreed` (printed once, by rank 0, by the CLI).
3. The broadcast is really skipped: with the check stubbed out, differently seeded models stay
   different after wrap(); without --init-from-seed, wrap() makes them equal (rank 0's).
Each rank writes OUT_DIR/rank<r>.json.
"""
import dataclasses
import json
import sys
from pathlib import Path

import torch

from train.config import Config
from train.errors import UsageError
from train.engines import create


def model_from(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 3))


def wrapped_sum(engine, seed: int, init_from_seed: bool) -> float:
    """wrap() a model built from `seed`; the sum of its weights afterwards."""
    engine.cfg = dataclasses.replace(engine.cfg, init_from_seed=init_from_seed)
    model = model_from(seed)
    model, _ = engine.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return sum(p.double().sum().item() for p in engine.unwrap(model).parameters())


def main():
    engine_name, out_dir = sys.argv[1], Path(sys.argv[2])
    engine = create(Config(engine=engine_name))
    result = {"rank": engine.rank}
    wrapped_sum(engine, 0, init_from_seed=True)
    result["same_seed_passed"] = True
    try:
        wrapped_sum(engine, engine.rank, init_from_seed=True)  # rank 1: another seed
        result["error"] = None
    except UsageError as err:
        result["error"], result["agreed"] = str(err), getattr(err, "raised_everywhere", False)
    sums = {}
    check = engine._check_same_model
    engine._check_same_model = lambda model: None  # broadcast skipped, nothing checked
    sums["init_from_seed"] = engine.gather_object(wrapped_sum(engine, engine.rank, init_from_seed=True))
    engine._check_same_model = check
    sums["broadcast"] = engine.gather_object(wrapped_sum(engine, engine.rank, init_from_seed=False))
    result["weight_sums_after_wrap"] = sums
    (out_dir / f"rank{engine.rank}.json").write_text(json.dumps(result))
    engine.shutdown()


if __name__ == "__main__":
    main()
