"""The shared step timer (moetrain.timing) on the CPU: every call is made, warm-up calls are not
timed, and a step's time is at least the time it sleeps."""

import time

from moetrain.timing import median_ms, step_times_ms


def test_warm_up_calls_are_made_and_not_timed():
    calls = []
    times = step_times_ms(lambda: calls.append(1), "cpu", warmup=4, steps=7)
    assert len(calls) == 11 and len(times) == 7


def test_a_step_lasts_at_least_its_sleep():
    slow = median_ms(lambda: time.sleep(0.02), "cpu", warmup=1, steps=3)
    quick = median_ms(lambda: None, "cpu", warmup=1, steps=3)
    assert 20.0 <= slow < 2000.0 and quick < slow
