"""Settings that follow from the global batch: the peak LR and the warmup (its split into ranks, per-rank
batch and accumulation steps: train/batches.py).

Without a preset the trainer picks the peak LR and the warmup from the global batch
(docs/learning_rate.md says why these rules):
- LARS, global batch >= 1632: the MLPerf reference convergence table, interpolated linearly in
  log2(batch) between its points and held at its ends.
- LARS, global batch < 1632: a power law through the table's smallest point (1632: LR 7.4) and the
  tested `smoke` recipe (64: LR 4.0), LR = 4.0 x (batch / 64) ** 0.19; warmup 2 epochs (both points').
- SGD and RMSprop warm-up: the linear scaling rule, LR = 0.1 x batch / 256, warmup 5 epochs above batch 256, none below.
A chosen warmup never takes more than 40% of the run; a warmup given that is not shorter than the
run is cut to 40% as well, and the header line says so.
"""
import math

from train.errors import UsageError

DEFAULT_PER_RANK_BATCH = 256
WARMUP_SHARE_LIMIT = 0.4

# MLPerf ResNet-50 reference convergence points: global batch -> (peak LR, warmup epochs)
MLPERF_LARS_POINTS = {1632: (7.4, 2), 3264: (10.5, 2), 4096: (10.0, 5), 8192: (17.0, 5), 13056: (12.8, 9),
                      32768: (21.2, 16), 49152: (19.405, 24), 65536: (24.699, 31)}
LINEAR_SCALING = ("sgd", "rmsprop-warmup")  # optimizers whose LR follows 0.1 x batch / 256
SMOKE_POINT = (64, 4.0, 2)  # the tested small-batch LARS recipe: batch, peak LR, warmup epochs


def interpolate(points: dict, batch: int, column: int) -> float:
    batches = sorted(points)
    if batch <= batches[0]:
        return points[batches[0]][column]
    if batch >= batches[-1]:
        return points[batches[-1]][column]
    upper = next(b for b in batches if b >= batch)
    lower = batches[batches.index(upper) - 1]
    share = (math.log2(batch) - math.log2(lower)) / (math.log2(upper) - math.log2(lower))
    return points[lower][column] + share * (points[upper][column] - points[lower][column])


def rule_lr_and_warmup(optimizer: str, global_batch: int) -> tuple[float, float]:
    """The peak LR and warmup epochs the rules above give for a global batch."""
    if optimizer in LINEAR_SCALING:
        return 0.1 * global_batch / 256, (5.0 if global_batch > 256 else 0.0)
    smallest = min(MLPERF_LARS_POINTS)
    if global_batch >= smallest:
        return interpolate(MLPERF_LARS_POINTS, global_batch, 0), interpolate(MLPERF_LARS_POINTS, global_batch, 1)
    batch, lr, warmup = SMOKE_POINT
    exponent = math.log(MLPERF_LARS_POINTS[smallest][0] / lr) / math.log(smallest / batch)
    return lr * (global_batch / batch) ** exponent, float(warmup)


def lr_and_warmup(cfg, global_batch: int) -> tuple[float, float, str]:
    """(peak LR, warmup epochs, a note for the header line saying what was chosen and why)."""
    notes = []
    rule_lr, rule_warmup = rule_lr_and_warmup(cfg.optimizer, global_batch)
    if cfg.lr and cfg.lr_per_256:
        if not math.isclose(cfg.lr, cfg.lr_per_256 * global_batch / 256, rel_tol=1e-9):
            raise UsageError(f"--lr {cfg.lr:g} disagrees with --lr-per-256 {cfg.lr_per_256:g} x {global_batch} / 256 = "
                             f"{cfg.lr_per_256 * global_batch / 256:g}; give one of them")
        lr = cfg.lr
    elif cfg.lr_per_256:
        lr = cfg.lr_per_256 * global_batch / 256
    elif cfg.lr:
        lr = cfg.lr
    else:
        lr = rule_lr
        notes.append(f"lr from global batch {global_batch}")
    warmup = cfg.warmup_epochs
    if warmup < 0:
        warmup = min(rule_warmup, WARMUP_SHARE_LIMIT * cfg.epochs)
        notes.append("warmup from global batch" + (" and run length" if warmup < rule_warmup else ""))
    elif warmup >= cfg.epochs:
        warmup = WARMUP_SHARE_LIMIT * cfg.epochs
        notes.append(f"warmup cut from {cfg.warmup_epochs:g} to {warmup:g} epochs: a warmup "
                     f"{'as long as' if cfg.warmup_epochs == cfg.epochs else 'longer than'} the {cfg.epochs}-epoch "
                     "run leaves no decay")
    return lr, warmup, "; ".join(notes)

