"""What changes during a run, in one place the loop asks at every step and epoch.

A schedule answers `step_settings(k)`: the optimizer settings of the k-th optimizer step (the
learning rate today; an optimizer's mode, such as an RMSprop-to-SGD share, is one more key), and
`augment(epoch)`: whether training augmentation is on in that epoch (0-based). Schedules are
registered by name (`--lr-schedule`); a new recipe mechanism is a new class here, not a branch in
the loop.
"""

SCHEDULES = {}  # --lr-schedule NAME -> class built by build_schedule


def register(name: str):
    def add(cls):
        SCHEDULES[name] = cls
        return cls
    return add


class Schedule:
    """Defaults: the LR of lr(k) and nothing else changes."""

    def lr(self, step: int) -> float:
        raise NotImplementedError

    def step_settings(self, step: int) -> dict:
        return {"lr": self.lr(step)}

    def augment(self, epoch: int) -> bool:
        return True

    def mllog_settings(self) -> dict:
        """The schedule's own MLLOG keys, without the optimizer's prefix (lars_opt_, sgd_opt_)."""
        return {}

    @classmethod
    def from_settings(cls, cfg, steps_per_epoch: int) -> "Schedule":
        raise NotImplementedError


def build_schedule(cfg, steps_per_epoch: int) -> Schedule:
    return SCHEDULES[cfg.lr_schedule].from_settings(cfg, steps_per_epoch)


@register("warmup-poly")
class WarmupPolySchedule(Schedule):
    """Per-step LR of MLPerf LARS (docs/lars.md): lr(k) for the k-th optimizer step, k = 1..total_steps.

    warmup (k <= W):  base * k / W
    decay  (k >  W):  end + (base - end) * (1 - (k - W) / (total - W)) ** power
    so the first step already moves the weights and the last one runs at exactly `end`.
    """

    def __init__(self, base_lr: float, warmup_steps: int, total_steps: int,
                 end_lr: float = 1e-4, power: float = 2.0):
        if total_steps <= 0:
            raise ValueError("total_steps must be positive")
        self.base_lr, self.end_lr, self.power = base_lr, end_lr, power
        self.warmup_steps = min(max(warmup_steps, 0), total_steps)
        self.total_steps = total_steps

    @classmethod
    def from_settings(cls, cfg, steps_per_epoch: int) -> "WarmupPolySchedule":
        return cls(cfg.lr, round(cfg.warmup_epochs * steps_per_epoch), cfg.epochs * steps_per_epoch,
                   cfg.end_lr, cfg.lr_decay_power)

    def mllog_settings(self) -> dict:
        return {"end_learning_rate": self.end_lr, "learning_rate_decay_poly_power": self.power,
                "learning_rate_decay_steps": self.decay_steps}

    @property
    def decay_steps(self) -> int:
        return self.total_steps - self.warmup_steps

    def lr(self, step: int) -> float:
        if step <= self.warmup_steps:
            return self.base_lr * step / self.warmup_steps
        done = min(step - self.warmup_steps, self.decay_steps) / self.decay_steps
        return self.end_lr + (self.base_lr - self.end_lr) * (1.0 - done) ** self.power

    __call__ = lr


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
