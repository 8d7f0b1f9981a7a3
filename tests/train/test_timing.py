"""The shared step timer (moetrain.timing) on the CPU: every call is made, warm-up calls are not
timed, and a step's time is at least the time it sleeps."""

import time

import pytest

from moetrain.timing import median_ms, step_times_ms


def test_warm_up_calls_are_made_and_not_timed():
    calls = []
    times = step_times_ms(lambda: calls.append(1), "cpu", warmup=4, steps=7)
    assert len(calls) == 11 and len(times) == 7


def test_a_step_lasts_at_least_its_sleep():
    slow = median_ms(lambda: time.sleep(0.02), "cpu", warmup=1, steps=3)
    quick = median_ms(lambda: None, "cpu", warmup=1, steps=3)
    assert 20.0 <= slow < 2000.0 and quick < slow


def test_kernel_table_divides_by_the_steps_and_sorts_by_time():
    """The kernel table of --profile: per-step milliseconds and launches, most time first, the
    shares of the GPU's busy time, the costliest `rows` and one line for the rest."""
    import random

    from moetrain.timing import kernel_table

    rng = random.Random()
    kernels = [(f"kernel_{i}", rng.uniform(1, 5000), rng.randint(1, 30)) for i in range(12)]
    steps, wall_ms = 3, 50.0
    lines = kernel_table(kernels, steps, wall_ms, rows=5).splitlines()
    busy_ms = sum(us for _, us, _ in kernels) / 1e3 / steps
    assert lines[0].startswith(f"GPU busy {busy_ms:.2f} ms a step (profiled) of a 50.00 ms step")
    expected = sorted(kernels, key=lambda k: k[1], reverse=True)
    for line, (name, us, count) in zip(lines[2:7], expected):
        ms, share, launches, printed_name = line.split()
        assert printed_name == name
        assert float(ms) == pytest.approx(us / 1e3 / steps, abs=1e-3)
        assert float(launches) == pytest.approx(count / steps, abs=0.05)
        assert float(share.rstrip("%")) == pytest.approx(100 * us / 1e3 / steps / busy_ms, abs=0.05)
    rest = sum(us for _, us, _ in expected[5:]) / 1e3 / steps
    assert lines[7].split()[0] == f"{rest:.3f}" and lines[7].endswith("the other 7 kernels")
