import pytest

from train.schedule import WarmupPolySchedule


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
