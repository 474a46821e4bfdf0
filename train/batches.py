"""How a global batch splits: global batch = ranks x per-rank batch x accumulation steps (the batches
whose gradients add up before one all-reduce and one optimizer step). Any two settings give the third;
what start-up chooses where they leave it open, and how a --batch-schedule phase splits, are here
(docs/accumulation.md has the table). The run's trajectory depends on the global batch and the per-rank
batch only: R ranks x N steps and R x N ranks x 1 step are the same run (data/sharding.py).
"""
from train.errors import UsageError
from train.rules import DEFAULT_PER_RANK_BATCH
from train.schedule import batch_phases


def batch_sizes(batch_size: int, global_batch_size: int, world_size: int, default: int = DEFAULT_PER_RANK_BATCH,
                accumulation_steps: int = 0, fits: int = 0) -> tuple[int, int, int]:
    """(per-rank batch, global batch, accumulation steps) from the three settings (0 = not set) and the
    rank count, global batch = ranks x batch x steps (docs/accumulation.md has the table): any two give
    the third; a global batch alone takes `default` per rank, or where ranks x `default` is less than it
    the fewest steps that make a whole per-rank batch of at most `default`; neither batch given takes
    `default` per rank. `fits`: the largest per-rank batch whose step fits the device (0: no limit
    known), which accumulation steps that were asked for must respect."""
    batch, total, steps = batch_size, global_batch_size, accumulation_steps
    if batch and total and steps:
        if world_size * batch * steps != total:
            raise UsageError(f"--batch-size {batch} x {world_size} rank(s) x --accumulation-steps {steps} = "
                             f"{world_size * batch * steps} disagrees with --global-batch-size {total}; "
                             f"{_ways(total, world_size, fits or batch)}")
    elif batch and total:
        if total % (world_size * batch):
            raise UsageError(f"--global-batch-size {total} is not a whole number of {world_size} rank(s) x --batch-size "
                             f"{batch}; {_ways(total, world_size, batch)}")
        steps = total // (world_size * batch)
    elif total:
        if total % world_size:
            raise UsageError(f"--global-batch-size {total} does not divide over {world_size} ranks; "
                             "choose a multiple of the rank count")
        if steps:
            if total % (world_size * steps):
                raise UsageError(f"--global-batch-size {total} does not split into {world_size} rank(s) x "
                                 f"--accumulation-steps {steps} whole batches; {_ways(total, world_size, fits or total)}")
            batch = total // (world_size * steps)
        else:
            steps = fewest_steps(total // world_size, default)
            batch = total // (world_size * steps)
    else:
        batch, steps = batch or default, steps or 1
        total = world_size * batch * steps
    if accumulation_steps and not batch_size and fits and batch > fits:  # (a batch given is the user's to size)
        raise UsageError(f"--accumulation-steps {accumulation_steps} leaves a per-rank batch of {batch}, more than the "
                         f"{fits} whose step fits this device; {_ways(total, world_size, fits)}")
    return batch, total, steps


def fewest_steps(per_rank: int, largest: int, at_least: int = 1) -> int:
    """The fewest accumulation steps, from `at_least` on, that split a rank's share of a global batch into
    whole batches of at most `largest` images (the share itself, batches of 1, at worst)."""
    splits = (steps for steps in range(at_least, per_rank + 1) if per_rank % steps == 0 and per_rank // steps <= largest)
    return next(splits, per_rank)


def _ways(total: int, world_size: int, largest: int) -> str:
    """What would work for a global batch on this rank count: a few (batch, steps) pairs, largest batch first."""
    if total % world_size:
        return "choose a global batch that divides over the ranks"
    share = total // world_size
    pairs = [(share // steps, steps) for steps in range(1, share + 1) if share % steps == 0 and share // steps <= largest]
    working_pairs = " or ".join(f"--batch-size {batch} --accumulation-steps {steps}" for batch, steps in pairs[:3])
    return f"global batch {total} on {world_size} rank(s) is e.g. {working_pairs}" if working_pairs else "give two of the three"


def phase_split(global_batch: int, world_size: int, steps: int, largest: int) -> tuple[int, int]:
    """(per-rank batch, accumulation steps) of a --batch-schedule phase's global batch: the run's steps
    kept and the per-rank batch following (as without accumulation), unless that batch would be more
    than `largest` (the run's batch or the largest that fits, whichever is more) or not whole: then the
    fewest steps above that give a whole batch that is not."""
    share = global_batch // world_size
    if share % steps == 0 and share // steps <= largest:
        return share // steps, steps
    more = fewest_steps(share, largest, at_least=steps)
    return share // more, more


def split_phases(run) -> list[tuple[int, int, int, int]]:
    """(epochs done, global batch, per-rank batch, accumulation steps) of each batch phase of a resolved
    run (its first, then --batch-schedule's): phase_split, on the rank count the first phase implies."""
    steps = max(run.accumulation_steps, 1)
    if not (run.batch_size and run.global_batch_size):  # (settings not resolved: one phase, as given)
        return [(0, run.global_batch_size, run.batch_size, steps)]
    ranks = run.global_batch_size // (run.batch_size * steps)
    largest = getattr(run, "largest_batch", 0) or max(run.batch_size, DEFAULT_PER_RANK_BATCH)
    return [(done, total, *phase_split(total, ranks, steps, largest)) for done, total in batch_phases(run)]


def accumulates(run) -> bool:
    """Whether some phase of a resolved run adds up the gradients of more than one batch per step."""
    return any(steps > 1 for *_, steps in split_phases(run))


def epoch_split(run, epoch: int) -> tuple[int, int, int]:
    """(global batch, per-rank batch, accumulation steps) of a resolved run's 0-based `epoch`."""
    return [phase[1:] for phase in split_phases(run) if epoch >= phase[0]][-1]


def split_batch(cfg, engine, precision: str, largest_crop: int, start=None) -> tuple[int, int, int, int, str]:
    """(per-rank batch, global batch, accumulation steps, the largest per-rank batch a later batch phase
    may take, the header's note on how the batch was chosen) for this rank count. The batch that fits a
    GPU comes from the memory model at the run's largest training crop (--resolution-schedule's end);
    on a CPU it is 256. A continued run (`start`, a rundir.Start: its saved_batch) keeps its per-rank
    batch where the ranks x that batch divide its global batch, changing the accumulation steps;
    elsewhere the per-rank batch follows the rank count."""
    from train.device_choices import default_batch  # (torch: not for the planner's fast --help)
    world_size, total, on_gpu = engine.world_size, cfg.global_batch_size, engine.device.type == "cuda"
    # (the memory model: where the batch is chosen, or derived from the global batch)
    fitting, note = (default_batch(engine.device, precision, largest_crop, cfg.arch) if on_gpu and not cfg.batch_size
                     else (DEFAULT_PER_RANK_BATCH, ""))
    saved_batch = start.saved_batch if start else ()
    if saved_batch and cfg.division == "closed":  # (MLPerf's closed division: one N for the whole run)
        batch, total, steps = batch_sizes(0, total, world_size, fitting, saved_batch[1])
    elif saved_batch:
        kept, _ = saved_batch
        if total % (world_size * kept) == 0:
            batch, steps = kept, total // (world_size * kept)
        else:
            batch, total, steps = batch_sizes(0, total, world_size, max(kept, fitting))
    else:
        batch, total, steps = batch_sizes(cfg.batch_size, total, world_size, fitting, cfg.accumulation_steps,
                                          fitting if on_gpu else 0)
    chose = not (cfg.batch_size or saved_batch) and (
        not cfg.global_batch_size or (steps > 1 and not cfg.accumulation_steps))
    return batch, total, steps, max(batch, fitting), note if chose else ""
