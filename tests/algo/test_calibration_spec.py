"""The project's solve (RatioStats pooled over micro-batches + CalibratedClipper.solve) against the independent
numpy implementation of the spec in tests/calibration_spec.py, on random pooled token sets."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from calibration_spec import spec_solve
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.config.algo import CalibrationConfig


def _tokens(seed: int, n: int, noise: float, hp_scale: float):
    g = torch.Generator().manual_seed(seed)
    r_hp = torch.exp(torch.randn(n, generator=g) * hp_scale)
    r8 = r_hp * torch.exp(torch.randn(n, generator=g) * noise)
    adv = torch.randn(n, generator=g)
    adv[torch.rand(n, generator=g) < 0.1] = 0.0  # tokens of groups without reward spread
    return r8.float(), r_hp.float(), adv.float()


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 600), st.floats(0.0, 0.3), st.floats(0.01, 0.4), st.booleans(),
       st.integers(1, 5))
def test_solve_matches_the_spec(seed, n, noise, hp_scale, relax_only, parts):
    r8, r_hp, adv = _tokens(seed, n, noise, hp_scale)
    clipper = CalibratedClipper(CalibrationConfig(enabled=True, smoothing=0.0, relax_only=relax_only),
                                eps_low=0.2, eps_high=0.28)
    stats = clipper.new_stats(reference=True)
    for idx in torch.arange(n).chunk(parts):  # micro-batches add locally, one solve
        stats.add(r8[idx], adv[idx], ratio_hp=r_hp[idx])
    sol = clipper.solve(stats)
    want = spec_solve(r8.numpy(), r_hp.numpy(), adv.numpy(), eps_low=0.2, eps_high=0.28, relax_only=relax_only)
    assert clipper.targets.alpha == want.alpha
    assert clipper.targets.rho == pytest.approx(want.rho, rel=1e-12) or (math.isinf(want.rho) and math.isinf(clipper.targets.rho))
    assert sol.lower == want.lower
    assert sol.lower_raw == want.lower_raw or (math.isnan(sol.lower_raw) and math.isnan(want.lower_raw))
    assert sol.upper == want.upper
    assert sol.upper_raw == want.upper_raw or (math.isnan(sol.upper_raw) and math.isnan(want.upper_raw))
    # what the loss then does with L: exactly floor(alpha |N|) negative ratios sit below the unclamped quantile
    neg = adv < 0
    if neg.any() and not relax_only and want.lower == want.lower_raw:
        assert int((r8[neg] < sol.lower).sum()) == round(want.alpha * int(neg.sum()))


def test_spec_checker_fails_on_a_wrong_quantile():
    r8, r_hp, adv = _tokens(3, 400, 0.1, 0.3)
    want = spec_solve(r8.numpy(), r_hp.numpy(), adv.numpy(), eps_low=0.2, eps_high=0.28, relax_only=False)
    negs = np.sort(r8.numpy()[adv.numpy() < 0])
    k = int(round(want.alpha * negs.size))
    assert want.lower_raw == negs[k]  # the (floor(alpha |N|) + 1)-th order statistic, 1-based
    assert want.lower_raw != negs[k - 1] and want.lower_raw != negs[k + 1]
