import sys

import pytest

from train.config import Config
from train.schedule import SCHEDULES, EpochClock, EpochPlan, LRSchedule, WarmupPolySchedule, build_lr_schedule


def test_warmup_then_poly_decay_values():
    s = WarmupPolySchedule(base_lr=10.0, warmup_steps=5, total_steps=25, end_lr=1e-4, power=2)
    assert s(1) == pytest.approx(2.0)          # 10 * 1/5
    assert s(3) == pytest.approx(6.0)
    assert s(5) == pytest.approx(10.0)         # peak at the end of warmup
    assert s(15) == pytest.approx(1e-4 + (10 - 1e-4) * 0.5 ** 2)   # half-way through 20 decay steps
    assert s(24) == pytest.approx(1e-4 + (10 - 1e-4) * (1 / 20) ** 2)
    assert s(25) == pytest.approx(1e-4)        # exactly the end LR at the last step
    assert s.decay_steps == 20


def test_no_warmup_and_monotone_decay():
    s = WarmupPolySchedule(base_lr=2.0, warmup_steps=0, total_steps=10, end_lr=1e-4)
    values = [s(k) for k in range(1, 11)]
    assert values == sorted(values, reverse=True)
    assert values[0] == pytest.approx(1e-4 + (2 - 1e-4) * 0.9 ** 2)


def settings_with_every_mechanism(lr_schedule: str) -> Config:
    """A run of 4 epochs of 100 images that uses each thing a schedule or a plan answers: a warmup from
    a start LR, a second batch phase, a blended optimizer's SGD share, a crop ramp, augmentation off."""
    return Config(lr=1.0, warmup_epochs=1, warmup_start_lr=0.1, epochs=4, global_batch_size=10, batch_schedule="2:20",
                  optimizer="rmsprop-warmup", lr_schedule=lr_schedule, lr_phases="1:0.5", lr_decay_epochs="3",
                  resolution_schedule="16:32:1:3:8", augment_off_epoch=3)


def test_the_lr_schedule_holds_no_per_epoch_plan_and_the_plan_no_lr():
    cfg = settings_with_every_mechanism("cosine")
    clock = EpochClock.of(cfg, 100)  # 10, 10, 5, 5 steps
    lr_schedule, plan = build_lr_schedule(cfg, clock), EpochPlan.of(cfg, clock)
    per_epoch = ("image_size", "global_batch", "augment", "resolution", "base_size", "augment_off_epoch")
    assert [name for name in per_epoch if hasattr(lr_schedule, name)] == []
    assert [name for name in ("lr", "step_settings", "share", "phase_peaks", "warmup_steps") if hasattr(plan, name)] == []
    # what each answers, by hand: the ramp 16 px until 1 epoch is done, 32 once 3 are, 24 between
    assert [plan.image_size(e) for e in range(4)] == [16, 16, 24, 32]
    assert [plan.global_batch(e) for e in range(4)] == [10, 10, 20, 20]
    assert [plan.augment(e) for e in range(4)] == [True, True, False, False]  # off from the 3rd epoch
    assert lr_schedule.step_settings(1) == {"lr": pytest.approx(0.1 + 0.9 / 10), "sgd_share": 0.0}


def test_every_lr_schedule_and_the_plan_are_whole_when_built(monkeypatch):
    """Nothing is set on a schedule or a plan once its constructor has returned: the factories hand
    over finished objects (no attribute patched onto a half-built one)."""
    late, during = [], []

    def watched(self, name, value):
        caller = sys._getframe(1)  # (the function that assigns)
        inside = caller.f_code.co_name == "__init__" and caller.f_locals.get("self") is self
        (during if inside else late).append(f"{type(self).__name__}.{name} set in {caller.f_code.co_name}")
        object.__setattr__(self, name, value)

    monkeypatch.setattr(LRSchedule, "__setattr__", watched)
    monkeypatch.setattr(EpochPlan, "__setattr__", watched)
    for name in SCHEDULES:
        cfg = settings_with_every_mechanism(name)
        clock = EpochClock.of(cfg, 100)
        build_lr_schedule(cfg, clock)
        EpochPlan.of(cfg, clock)
    assert late == []
    assert len(during) > 2 * len(SCHEDULES) and any(entry.startswith("EpochPlan.") for entry in during)  # (the watch
    # sees the constructors' own assignments, the plan's too)
