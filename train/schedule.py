"""What changes during a run, in one place the loop asks at every step and epoch.

A schedule answers `step_settings(k)`: the optimizer settings of the k-th optimizer step (the
learning rate; for a blended optimizer also its momentum-SGD share), `global_batch(epoch)`: the
global batch of an epoch (batch-size control), `image_size(epoch)`: its training crop size
(progressive resizing), and `augment(epoch)`: whether training augmentation is on in that epoch
(all 0-based). Schedules are registered by name (`--lr-schedule`); a new
recipe mechanism is a new class here, not a branch in the loop.

Every schedule warms up linearly per step from --warmup-start-lr to the peak over the warmup, then
follows its own shape. Under batch-size control (--batch-schedule) the steps per epoch change with
the global batch (EpochClock), and the peak LR of a later batch phase is the first one scaled by
the LR rule's ratio for the two batches (docs/learning_rate.md).
"""
import math
from bisect import bisect_left

SCHEDULES = {}  # --lr-schedule NAME -> class built by build_schedule


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


class ResolutionRamp:
    """Progressive resizing (--resolution-schedule 'START:END:FROM:TO[:STEP]'): the training crop size
    of an epoch, START until FROM epochs are done, END once TO are, and between them a straight line
    in the epochs done rounded to the nearest multiple of STEP (32 unless given), as FFCV's ImageNet
    example ramps it. Small crops early are cheap (a step's work grows with the pixels) and, with the
    evaluation at a higher resolution, cost little accuracy (Touvron et al. 2019)."""

    def __init__(self, start: int, end: int, first: int, last: int, step: int = 32):
        self.start, self.end, self.first, self.last, self.step = start, end, first, last, step

    def __call__(self, epoch: int) -> int:
        """The crop size of the epoch (0-based: `epoch` epochs are done before it)."""
        if epoch >= self.last:
            return self.end
        if epoch <= self.first:
            return self.start
        size = self.start + (self.end - self.start) * (epoch - self.first) / (self.last - self.first)
        rounded = round(size / self.step) * self.step  # (half to even, as numpy's round in FFCV's)
        return min(max(rounded, min(self.start, self.end)), max(self.start, self.end))

    def sizes(self, epochs: int) -> list[int]:
        return [self(epoch) for epoch in range(epochs)]


# every crop size in px (--image-size, --eval-image-size, the ramp's ends; docs/time_to_accuracy.md)
MIN_CROP, MAX_CROP = 16, 1024
NO_RAMP = ("", "none", "off")  # --resolution-schedule's words for "no ramp"


def resolution_ramp(text: str) -> ResolutionRamp | None:
    """--resolution-schedule's ramp, None for '', 'none' or 'off'; a ValueError naming the flag, the
    value and what to give when it is not one."""
    if text.strip().lower() in NO_RAMP:
        return None
    said, example = f"--resolution-schedule {text!r}", "e.g. 160:192:65:76"
    parts = [part.strip() for part in text.split(":")]
    if len(parts) not in (4, 5):
        raise ValueError(f"{said}: has {len(parts)} value{'s' if len(parts) > 1 else ''}, not 4 or 5; give "
                         f"START:END:FROM:TO[:STEP], {example}")
    numbers = []
    units = ("pixels", "pixels", "epochs", "epochs", "pixels")
    for part, name, unit in zip(parts, ("START", "END", "FROM", "TO", "STEP"), units):
        try:
            numbers.append(int(part))
        except ValueError:
            what = f"{part} is not a whole number" if _is_number(part) else f"{part!r} is not a number"
            raise ValueError(f"{said}: {name} {what} of {unit}; give whole {unit}, {example}") from None
    start, end, first, last, step = numbers + [32] * (5 - len(numbers))
    for name, size in (("START", start), ("END", end)):
        if not MIN_CROP <= size <= MAX_CROP:
            raise ValueError(f"{said}: {name} {size} is not a crop size from {MIN_CROP} to {MAX_CROP} px; give one "
                             f"in that range, {example}")
    if step < 8 or step % 8:
        raise ValueError(f"{said}: STEP {step} is not a positive multiple of 8 (the ramp rounds its sizes to multiples of "
                         "STEP); give 8, 16, 32 or another multiple of 8, e.g. 160:192:65:76:32")
    if first < 0:
        raise ValueError(f"{said}: FROM {first} is not 0 or more; give the epochs done before the ramp, {example}")
    if last < first:
        raise ValueError(f"{said}: FROM {first} is after TO {last}; give FROM not above TO, {example}")
    return ResolutionRamp(start, end, first, last, step)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def crop_note(cfg) -> str:
    """The header's word on a run's training crops, "" when there is none to say: the ramp and the
    evaluation size an explicit --image-size left out (train/cli.py), a ramp that never moves within the run's epochs (the crop
    size it keeps), a ramp that shrinks."""
    notes = [f"{cfg.left_out} left out: --image-size {cfg.image_size} given"] if cfg.left_out else []
    ramp = resolution_ramp(cfg.resolution_schedule)
    if ramp and ramp.start != ramp.end:
        if set(ramp.sizes(cfg.epochs)) == {ramp.start}:
            why = f"FROM {ramp.first}" if ramp.first >= cfg.epochs - 1 else f"rounded to multiples of {ramp.step}"
            notes.append(f"the ramp keeps {ramp.start} px crops throughout this {cfg.epochs}-epoch run ({why})")
        elif ramp.end < ramp.start:
            notes.append(f"the ramp shrinks the training crops from {ramp.start} to {ramp.end} px")
    return "; ".join(notes)


def training_crops(image_size: int, resolution_schedule: str) -> tuple[int, int]:
    """The smallest and the largest training crop of a run (the ramp's steps stay between its ends)."""
    ramp = resolution_ramp(resolution_schedule)
    return (min(ramp.start, ramp.end), max(ramp.start, ramp.end)) if ramp else (image_size, image_size)


def largest_image_size(cfg) -> int:
    """The largest training crop of a run (what its per-GPU batch must fit)."""
    return training_crops(cfg.image_size, cfg.resolution_schedule)[1]


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


class Schedule:
    """Warmup from `start_lr` over `warmup_steps` steps to decayed(warmup_steps, peak) (the peak
    itself unless a decay step or phase falls inside the warmup), then `decayed(step, peak)`."""
    start_lr = 0.0
    augment_off_epoch = 0  # from this epoch on (1-based), no augmentation; 0: never
    share = None  # SgdShareRamp of a blended optimizer
    clock = None
    resolution = None  # ResolutionRamp of progressive resizing
    base_size = 224  # the training crop size without one (--image-size)

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int):
        if total_steps <= 0:
            raise ValueError("total_steps must be positive")
        self.base_lr, self.total_steps = base_lr, total_steps
        self.warmup_steps = min(max(warmup_steps, 0), total_steps)
        self.phase_peaks = []  # (last step before a later batch phase, that phase's peak LR)

    @classmethod
    def from_settings(cls, cfg, clock: EpochClock) -> "Schedule":
        schedule = cls.build(cfg, clock)
        schedule.clock, schedule.start_lr, schedule.augment_off_epoch = clock, cfg.warmup_start_lr, cfg.augment_off_epoch
        schedule.resolution, schedule.base_size = resolution_ramp(cfg.resolution_schedule), cfg.image_size
        if cfg.optimizer == "rmsprop-warmup":
            schedule.share = SgdShareRamp(cfg.sgd_share_center, cfg.sgd_share_width)
        if len(clock.phases) > 1:
            from train.rules import rule_lr_and_warmup
            first = rule_lr_and_warmup(cfg.optimizer, clock.phases[0][1])[0]
            schedule.phase_peaks = [(clock.first_step(done), cfg.lr * rule_lr_and_warmup(cfg.optimizer, batch)[0] / first)
                                    for done, batch in clock.phases[1:]]
        return schedule

    @classmethod
    def build(cls, cfg, clock: EpochClock) -> "Schedule":
        raise NotImplementedError

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
        settings = {"lr": self.lr(step)}
        if self.share is not None:
            settings["sgd_share"] = self.share(self.clock.progress(step - 1))
        return settings

    def global_batch(self, epoch: int) -> int:
        return self.clock.global_batch(epoch)

    def image_size(self, epoch: int) -> int:
        """The training crop size of an epoch (0-based)."""
        return self.resolution(epoch) if self.resolution else self.base_size

    def augment(self, epoch: int) -> bool:
        return not (self.augment_off_epoch and epoch + 1 >= self.augment_off_epoch)

    def mllog_settings(self) -> dict:
        """The schedule's own MLLOG keys, without the optimizer's prefix (lars_opt_, sgd_opt_)."""
        return {}


def build_schedule(cfg, clock: EpochClock) -> Schedule:
    return SCHEDULES[cfg.lr_schedule].from_settings(cfg, clock)


@register("warmup-poly")
class WarmupPolySchedule(Schedule):
    """Per-step LR of MLPerf LARS (docs/lars.md): lr(k) for the k-th optimizer step, k = 1..total_steps.

    warmup (k <= W):  base * k / W
    decay  (k >  W):  end + (base - end) * (1 - (k - W) / (total - W)) ** power
    so the first step already moves the weights and the last one runs at exactly `end`.
    """

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int,
                 end_lr: float = 1e-4, power: float = 2.0):
        super().__init__(base_lr, warmup_steps, total_steps)
        self.end_lr, self.power = end_lr, power

    @classmethod
    def build(cls, cfg, clock):
        return cls(cfg.lr, clock.steps_until(cfg.warmup_epochs), clock.total_steps, cfg.end_lr, cfg.lr_decay_power)

    def mllog_settings(self) -> dict:
        return {"end_learning_rate": self.end_lr, "learning_rate_decay_poly_power": self.power,
                "learning_rate_decay_steps": self.decay_steps}

    @property
    def decay_steps(self) -> int:
        return self.total_steps - self.warmup_steps

    def decayed(self, step: int, peak: float) -> float:
        done = min(step - self.warmup_steps, self.decay_steps) / self.decay_steps
        return self.end_lr + (peak - self.end_lr) * (1.0 - done) ** self.power


class ToZeroSchedule(Schedule):
    """A step-free decay from the peak at the warmup's end to 0 at the last step (k = total_steps):
    `shape(done)` gives the fraction of the peak left when `done` of the decay steps are taken."""

    @classmethod
    def build(cls, cfg, clock):
        return cls(cfg.lr, clock.steps_until(cfg.warmup_epochs), clock.total_steps)

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
class MultiStepSchedule(Schedule):
    """Goyal et al.'s step decay: the peak times factor ** (milestones passed); a milestone is the
    last step of an epoch listed in --lr-decay-epochs."""

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int, milestones: list[int], factor: float):
        super().__init__(base_lr, warmup_steps, total_steps)
        self.milestones, self.factor = milestones, factor

    @classmethod
    def build(cls, cfg, clock):
        epochs = decay_epochs(cfg.lr_decay_epochs)
        return cls(cfg.lr, clock.steps_until(cfg.warmup_epochs), clock.total_steps,
                   [clock.first_step(e) for e in epochs], cfg.lr_decay_factor)

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
class PhasesSchedule(Schedule):
    """Akiba et al.'s slow start: piecewise-constant phases of the peak LR (--lr-phases
    'EPOCHS:FACTOR,...'); after the last phase its factor stays."""

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int, phases: list[tuple[int, float]]):
        super().__init__(base_lr, warmup_steps, total_steps)
        self.phases = phases  # (last step of the phase, factor)

    @classmethod
    def build(cls, cfg, clock):
        phases, done = [], 0
        for epochs, factor in lr_phases(cfg.lr_phases):
            done += epochs
            phases.append((clock.steps_until(done), factor))
        return cls(cfg.lr, clock.steps_until(cfg.warmup_epochs), clock.total_steps, phases)

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
