"""benchmarks/bench_scaling.py's pure helpers: the log-log exponent fit and the size names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scaling  # noqa: E402


def test_loglog_slope_power_laws_recovers_exponent():
    xs = [1e6, 3e7, 1.25e8, 5e8]
    for k in (1.0, 0.5, -0.7, 2.0):
        assert bench_scaling.loglog_slope(xs, [3.0 * x**k for x in xs]) == pytest.approx(k)


def test_loglog_slope_noisy_points_least_squares():
    # y = x on two points and y = 2x on the middle one: the fit is still close to 1
    assert bench_scaling.loglog_slope([1, 10, 100], [1, 20, 100]) == pytest.approx(1.0)
    # a constant cost has exponent 0
    assert bench_scaling.loglog_slope([4, 8, 16, 32], [2.5] * 4) == pytest.approx(0.0)


def test_loglog_slope_degenerate_input_raises():
    with pytest.raises(ValueError, match="need >= 2"):
        bench_scaling.loglog_slope([1, 0], [1, 1])  # a non-positive point is dropped
    with pytest.raises(ValueError, match="all x values are equal"):
        bench_scaling.loglog_slope([5, 5], [1, 2])


def test_model_config_sizes_grow_and_unknown_size_names_allowed():
    from areal.utils import memory_plan as mp

    n = [
        mp.ModelShape.from_hf_config(bench_scaling.model_config(s)).n_params()
        for s in bench_scaling.SHAPES
    ]
    assert n == sorted(n) and 0.5e6 < n[0] < 2e6 and 3e8 < n[-1] < 7e8
    assert bench_scaling.model_config("demo")["model_type"] == "qwen2"
    with pytest.raises(ValueError, match=r"size='7b'; allowed: \['125m'"):
        bench_scaling.model_config("7b")
