"""Per-step learning rate: linear warmup, then polynomial decay to an end LR (MLPerf LARS)."""


class WarmupPolySchedule:
    """lr(k) for the k-th optimizer step, k = 1..total_steps.

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

    @property
    def decay_steps(self) -> int:
        return self.total_steps - self.warmup_steps

    def __call__(self, step: int) -> float:
        if step <= self.warmup_steps:
            return self.base_lr * step / self.warmup_steps
        done = min(step - self.warmup_steps, self.decay_steps) / self.decay_steps
        return self.end_lr + (self.base_lr - self.end_lr) * (1.0 - done) ** self.power
