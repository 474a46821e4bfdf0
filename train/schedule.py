"""What changes during a run, asked by the loop at every step and epoch, in two objects.

The LR schedule (LRSchedule, one subclass per --lr-schedule, registered by name) answers
`step_settings(k)`: the optimizer settings of the k-th optimizer step (the learning rate; for a
blended optimizer also its momentum-SGD share). Every schedule warms up linearly per step from
--warmup-start-lr to the peak over the warmup, then follows its own shape; a new recipe mechanism is
a new class here, not a branch in the loop.

The EpochPlan answers, per epoch (0-based): `global_batch(epoch)` (batch-size control),
`image_size(epoch)`: its training crop size (progressive resizing, train/crops.py), and
`augment(epoch)`: whether training augmentation is on. Under batch-size control (--batch-schedule)
the steps per epoch change with the global batch (EpochClock), and the peak LR of a later batch
phase is the first one scaled by the LR rule's ratio for the two batches (docs/learning_rate.md).
"""
import math
from bisect import bisect_left

from train.crops import ResolutionRamp, resolution_ramp

SCHEDULES = {}  # --lr-schedule NAME -> LRSchedule subclass (build_lr_schedule)


def register(name: str):
    def add(cls):
        SCHEDULES[name] = cls
        return cls
    return add


def parse_pairs(text: str, flag: str, kinds=(int, int)) -> list[tuple]:
    """'A:B,C:D' as [(A, B), (C, D)]; a ValueError naming the flag when it is not that."""
    pairs = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            first, second = item.split(":")
            pairs.append((kinds[0](first), kinds[1](second)))
        except ValueError:
            raise ValueError(f"{flag} {text!r}: {item!r} is not NUMBER:NUMBER; write e.g. '30:69632'") from None
    return pairs


def batch_changes(text: str) -> list[tuple[int, int]]:
    """--batch-schedule 'E:B,...': (epochs done, global batch from then on), epochs increasing."""
    changes = parse_pairs(text, "--batch-schedule")
    epochs = [e for e, _ in changes]
    if any(e <= 0 for e in epochs) or epochs != sorted(set(epochs)) or any(b <= 0 for _, b in changes):
        raise ValueError(f"--batch-schedule {text!r}: epochs must be positive and increasing, batches positive")
    return changes


def batch_phases(cfg) -> list[tuple[int, int]]:
    """(epochs done, global batch from then on) of a run: its first global batch, then --batch-schedule."""
    return [(0, cfg.global_batch_size), *batch_changes(cfg.batch_schedule)]


class EpochClock:
    """Optimizer steps of each epoch when the global batch may change between epochs: an epoch of
    N images at global batch B has N // B steps (a last partial batch is dropped)."""

    def __init__(self, train_images: int, global_batch: int, changes=(), epochs: int = 1):
        self.train_images, self.epochs = train_images, epochs
        self.phases = [(0, global_batch), *changes]  # (epochs done, global batch from then on)
        if any(batch > train_images for _, batch in self.phases):
            raise ValueError(f"a global batch of {max(b for _, b in self.phases)} is more than the {train_images} "
                             "training images; lower it")
        self.first = [0]  # first[e]: optimizer steps before epoch e
        for epoch in range(epochs):
            self.first.append(self.first[-1] + self.steps_in(epoch))

    @classmethod
    def of(cls, cfg, train_images: int) -> "EpochClock":
        return cls(train_images, cfg.global_batch_size, batch_changes(cfg.batch_schedule), cfg.epochs)

    def global_batch(self, epoch: int) -> int:
        return [batch for done, batch in self.phases if epoch >= done][-1]

    def steps_in(self, epoch: int) -> int:
        return self.train_images // self.global_batch(epoch)

    @property
    def total_steps(self) -> int:
        return self.first[-1]

    def first_step(self, epoch: int) -> int:
        return self.first[min(epoch, self.epochs)]

    def steps_until(self, epochs: float) -> int:
        """Steps in the first `epochs` (fractional) epochs."""
        whole = min(int(epochs), self.epochs)
        if whole == self.epochs:
            return self.total_steps
        return self.first[whole] + round((epochs - whole) * self.steps_in(whole))

    def epoch_of(self, step: int) -> int:
        """The 0-based epoch of the step-th optimizer step (1-based)."""
        return min(max(bisect_left(self.first, step) - 1, 0), self.epochs - 1)

    def progress(self, steps_done: int) -> float:
        """Epochs done (fractional) after `steps_done` steps."""
        epoch = self.epoch_of(steps_done + 1)
        return epoch + (steps_done - self.first[epoch]) / max(self.steps_in(epoch), 1)

    def images(self, steps_done: int) -> int:
        """Training images of the first `steps_done` steps, over all ranks."""
        epoch = self.epoch_of(max(steps_done, 1))
        before = sum(self.steps_in(e) * self.global_batch(e) for e in range(epoch))
        return before + (steps_done - self.first[epoch]) * self.global_batch(epoch)


class SgdShareRamp:
    """The momentum-SGD share of a blended update (--optimizer rmsprop-warmup) against epochs done:
    0 before center - width/2, 1 after center + width/2, a half-cosine between. Akiba et al. describe
    an ELU-like rise centred near epoch 10 over about 5 epochs (a secondary source); the exact curve
    is not published, this one is ours."""

    def __init__(self, center: float, width: float):
        self.center, self.width = center, width

    def __call__(self, epochs_done: float) -> float:
        if self.width <= 0:
            return float(epochs_done >= self.center)
        t = min(max((epochs_done - self.center + self.width / 2) / self.width, 0.0), 1.0)
        return 0.5 - 0.5 * math.cos(math.pi * t)


class LRSchedule:
    """The optimizer settings of each optimizer step k (1-based): the LR warms up linearly from
    `start_lr` over `warmup_steps` steps to decayed(warmup_steps, peak) (the peak itself unless a decay
    step or phase falls inside the warmup), then follows `decayed(step, peak)`, the subclass's shape.
    Under batch-size control a later batch phase has its own peak (`phase_peaks`: the last step before
    the phase, its peak); a blended optimizer's momentum-SGD share (`share`, against the epochs that
    `clock` says are done) rides along in step_settings. Built whole by `of`; what changes per epoch
    is the EpochPlan's."""

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int, *, start_lr: float = 0.0,
                 phase_peaks: tuple = (), share: SgdShareRamp | None = None, clock: EpochClock | None = None):
        if total_steps <= 0:
            raise ValueError("total_steps must be positive")
        if share is not None and clock is None:
            raise ValueError("an SGD share ramp needs the run's EpochClock (its steps against epochs)")
        self.base_lr, self.total_steps, self.start_lr = base_lr, total_steps, start_lr
        self.warmup_steps = min(max(warmup_steps, 0), total_steps)
        self.phase_peaks, self.share, self.clock = tuple(phase_peaks), share, clock

    @classmethod
    def of(cls, cfg, clock: EpochClock) -> "LRSchedule":
        """The run's schedule, whole, from its settings and the optimizer steps of its epochs."""
        share = SgdShareRamp(cfg.sgd_share_center, cfg.sgd_share_width) if cfg.optimizer == "rmsprop-warmup" else None
        return cls(cfg.lr, clock.steps_until(cfg.warmup_epochs), clock.total_steps, start_lr=cfg.warmup_start_lr,
                   phase_peaks=phase_peaks(cfg, clock), share=share, clock=clock, **cls.shape_settings(cfg, clock))

    @classmethod
    def shape_settings(cls, cfg, clock: EpochClock) -> dict:
        """The keyword arguments of the subclass's own shape (its decay), from the run's settings."""
        return {}

    def peak(self, step: int) -> float:
        return ([self.base_lr] + [lr for last, lr in self.phase_peaks if step > last])[-1]

    def lr(self, step: int) -> float:
        peak = self.peak(step)
        if step <= self.warmup_steps:  # up to where the schedule stands at the warmup's end
            return self.start_lr + (self.decayed(self.warmup_steps, peak) - self.start_lr) * step / self.warmup_steps
        return self.decayed(step, peak)

    __call__ = lr

    def decayed(self, step: int, peak: float) -> float:
        raise NotImplementedError

    def step_settings(self, step: int) -> dict:
        """The param-group settings of the step: `lr`, and `sgd_share` for a blended optimizer."""
        settings = {"lr": self.lr(step)}
        if self.share is not None:
            settings["sgd_share"] = self.share(self.clock.progress(step - 1))
        return settings

    def mllog_settings(self) -> dict:
        """The schedule's own MLLOG keys, without the optimizer's prefix (lars_opt_, sgd_opt_)."""
        return {}


def phase_peaks(cfg, clock: EpochClock) -> tuple:
    """(last step before a later batch phase, that phase's peak LR): the first peak scaled by the LR
    rule's ratio for the two global batches (docs/learning_rate.md); () without batch-size control."""
    if len(clock.phases) == 1:
        return ()
    from train.rules import rule_lr_and_warmup
    first = rule_lr_and_warmup(cfg.optimizer, clock.phases[0][1])[0]
    return tuple((clock.first_step(done), cfg.lr * rule_lr_and_warmup(cfg.optimizer, batch)[0] / first)
                 for done, batch in clock.phases[1:])


def build_lr_schedule(cfg, clock: EpochClock) -> LRSchedule:
    """The run's LR schedule, the one --lr-schedule names."""
    return SCHEDULES[cfg.lr_schedule].of(cfg, clock)


def build_schedules(cfg, clock: EpochClock) -> "tuple[LRSchedule, EpochPlan]":
    """The run's two schedules, each whole: what moves per step (the LR and the optimizer's settings)
    and what changes per epoch (global batch, crop size, augmentation)."""
    return build_lr_schedule(cfg, clock), EpochPlan.of(cfg, clock)


class EpochPlan:
    """What the loop sets at the start of each epoch (0-based): its global batch (--batch-schedule,
    through the clock), its training crop size (--resolution-schedule's ramp, else --image-size) and
    whether training augmentation is on (off from --augment-off-epoch, counted from 1; 0: never)."""

    def __init__(self, clock: EpochClock, image_size: int, resolution: ResolutionRamp | None = None,
                 augment_off_epoch: int = 0):
        self.clock, self.base_size, self.resolution = clock, image_size, resolution
        self.augment_off_epoch = augment_off_epoch

    @classmethod
    def of(cls, cfg, clock: EpochClock) -> "EpochPlan":
        return cls(clock, cfg.image_size, resolution_ramp(cfg.resolution_schedule), cfg.augment_off_epoch)

    def global_batch(self, epoch: int) -> int:
        return self.clock.global_batch(epoch)

    def image_size(self, epoch: int) -> int:
        """The training crop size of an epoch."""
        return self.resolution(epoch) if self.resolution else self.base_size

    def augment(self, epoch: int) -> bool:
        return not (self.augment_off_epoch and epoch + 1 >= self.augment_off_epoch)


@register("warmup-poly")
class WarmupPolySchedule(LRSchedule):
    """Per-step LR of MLPerf LARS (docs/lars.md): lr(k) for the k-th optimizer step, k = 1..total_steps.

    warmup (k <= W):  base * k / W
    decay  (k >  W):  end + (base - end) * (1 - (k - W) / (total - W)) ** power
    so the first step already moves the weights and the last one runs at exactly `end`.
    """

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int,
                 end_lr: float = 1e-4, power: float = 2.0, **common):
        super().__init__(base_lr, warmup_steps, total_steps, **common)
        self.end_lr, self.power = end_lr, power

    @classmethod
    def shape_settings(cls, cfg, clock):
        return {"end_lr": cfg.end_lr, "power": cfg.lr_decay_power}

    def mllog_settings(self) -> dict:
        return {"end_learning_rate": self.end_lr, "learning_rate_decay_poly_power": self.power,
                "learning_rate_decay_steps": self.decay_steps}

    @property
    def decay_steps(self) -> int:
        return self.total_steps - self.warmup_steps

    def decayed(self, step: int, peak: float) -> float:
        done = min(step - self.warmup_steps, self.decay_steps) / self.decay_steps
        return self.end_lr + (peak - self.end_lr) * (1.0 - done) ** self.power


class ToZeroSchedule(LRSchedule):
    """A step-free decay from the peak at the warmup's end to 0 at the last step (k = total_steps):
    `shape(done)` gives the fraction of the peak left when `done` of the decay steps are taken."""

    def decayed(self, step: int, peak: float) -> float:
        decay_steps = self.total_steps - self.warmup_steps
        done = min(max(step - self.warmup_steps, 0), decay_steps) / decay_steps if decay_steps else 1.0
        return peak * self.shape(done)

    @staticmethod
    def shape(done: float) -> float:
        raise NotImplementedError


@register("cosine")
class CosineSchedule(ToZeroSchedule):
    """Half a cosine from the peak down to 0 (Loshchilov and Hutter's SGDR without restarts)."""

    @staticmethod
    def shape(done: float) -> float:
        return 0.5 * (1.0 + math.cos(math.pi * done))


@register("linear")
class LinearSchedule(ToZeroSchedule):
    """A straight line from the peak down to 0: with the linear warmup, FFCV's triangular schedule."""

    @staticmethod
    def shape(done: float) -> float:
        return 1.0 - done


@register("multistep")
class MultiStepSchedule(LRSchedule):
    """Goyal et al.'s step decay: the peak times factor ** (milestones passed); a milestone is the
    last step of an epoch listed in --lr-decay-epochs."""

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int, milestones: list[int], factor: float,
                 **common):
        super().__init__(base_lr, warmup_steps, total_steps, **common)
        self.milestones, self.factor = milestones, factor

    @classmethod
    def shape_settings(cls, cfg, clock):
        return {"milestones": [clock.first_step(e) for e in decay_epochs(cfg.lr_decay_epochs)],
                "factor": cfg.lr_decay_factor}

    def decayed(self, step: int, peak: float) -> float:
        return peak * self.factor ** sum(step > last for last in self.milestones)


def decay_epochs(text: str) -> list[int]:
    try:
        epochs = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--lr-decay-epochs {text!r} is not a list of epochs like '30,60,80'") from None
    if epochs != sorted(set(epochs)) or any(e <= 0 for e in epochs):
        raise ValueError(f"--lr-decay-epochs {text!r}: epochs must be positive and increasing")
    return epochs


@register("phases")
class PhasesSchedule(LRSchedule):
    """Akiba et al.'s slow start: piecewise-constant phases of the peak LR (--lr-phases
    'EPOCHS:FACTOR,...'); after the last phase its factor stays."""

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int, phases: list[tuple[int, float]], **common):
        super().__init__(base_lr, warmup_steps, total_steps, **common)
        self.phases = phases  # (last step of the phase, factor)

    @classmethod
    def shape_settings(cls, cfg, clock):
        phases, done = [], 0
        for epochs, factor in lr_phases(cfg.lr_phases):
            done += epochs
            phases.append((clock.steps_until(done), factor))
        return {"phases": phases}

    def decayed(self, step: int, peak: float) -> float:
        return peak * next((factor for last, factor in self.phases if step <= last), self.phases[-1][1])


def lr_phases(text: str) -> list[tuple[float, float]]:
    phases = parse_pairs(text, "--lr-phases", (float, float))
    if not phases or any(epochs <= 0 or factor < 0 for epochs, factor in phases):
        raise ValueError(f"--lr-phases {text!r}: give EPOCHS:FACTOR pairs with positive epochs, e.g. '40:0.5,30:0.075'")
    return phases


class EvalPlan:
    """When to evaluate (MLPerf: every N epochs after an offset, and at the end), and the MLLOG blocks
    that run from the epoch after one evaluation to the next. Epochs are numbered from 1."""

    def __init__(self, every: int, offset: int, epochs: int):
        self.every, self.offset, self.epochs = every, offset, epochs

    def due(self, epoch: int) -> bool:
        return self.every > 0 and (epoch + self.offset) % self.every == 0

    def next_eval(self, epoch: int) -> int:
        while epoch < self.epochs and not self.due(epoch):
            epoch += 1
        return epoch

    def starts_block(self, epoch: int) -> bool:
        return epoch == 1 or self.due(epoch - 1) or not self.every

    def block_start(self, epoch: int) -> int:
        while epoch > 1 and not self.starts_block(epoch):
            epoch -= 1
        return epoch
