"""Device-correct loss path (DESIGN.md "Device and dtype come from the data").

1. A static check: every tensor factory call in algo/, phases/ and parallel/collectives.py names its
   device (or carries `# device-ok: <why>`); the checker itself is shown to fail on bad code.
2. CUDA fake tensors (torch._subclasses.FakeTensorMode works on this CPU-only build as long as no
   op needs real data): the loss math, its metrics and the additive calibration statistics run on
   "cuda" inputs, and a CPU tensor created on the way raises a device mismatch. Data-dependent
   pieces (boolean indexing, the solve's scalar queries) cannot run under fake tensors; the GPU
   script tests/gpu/calibration_device_check.py runs them on a real GPU.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from device_lint import check_paths, check_source
from megatron_rl.algo import metrics as M
from megatron_rl.algo.calibration import RatioStats, reference_sums
from megatron_rl.algo.clipper import CalibratedClipper
from megatron_rl.algo.objective import policy_objective
from megatron_rl.algo.ratio_stats import HistSpec, local_histogram
from megatron_rl.config.algo import AlgoConfig, CalibrationConfig

ROOT = Path(__file__).resolve().parents[1]
CHECKED = [ROOT / "megatron_rl" / "algo", ROOT / "megatron_rl" / "phases", ROOT / "megatron_rl" / "parallel" / "collectives.py"]

BAD = '''
import torch
import torch as th
from torch import arange as ar, zeros_like

def f(x):
    a = torch.zeros(3)
    b = th.tensor(1.0, dtype=torch.float64)
    c = ar(5)
    d = torch.randperm(4, generator=None)  # device-ok:
    ok1 = torch.ones(2, device=x.device)
    ok2 = torch.full_like(x, 3.0)
    ok3 = zeros_like(x)
    ok4 = torch.empty(
        4,  # device-ok: a reason on any line of the call
    )
    ok5 = x.new_zeros(3)
    return a, b, c, d
'''


def test_checked_modules_create_tensors_on_the_datas_device():
    findings = check_paths(CHECKED)
    assert not findings, "\n".join(map(str, findings))


def test_checker_flags_factories_without_device():
    found = check_source(BAD, "bad.py")
    assert [(f.line, f.call) for f in found] == [(7, "zeros"), (8, "tensor"), (9, "arange"), (10, "randperm")]
    assert "bad.py:7: torch.zeros(...) without device=" in str(found[0])


fake_mode = pytest.importorskip("torch._subclasses.fake_tensor")


@pytest.fixture
def cuda_fake():
    """A FakeTensorMode in which `torch.empty(..., device='cuda')` works without CUDA.

    The megatron CPU compatibility layer (installed by any earlier learner test in this process) maps
    device="cuda" to cpu; it is suspended for the test.
    """
    from megatron_rl.parallel.compat import compat_mode_suspended

    # no skip when this fails: the pinned CPU torch makes CUDA fake tensors, and a build that cannot must show red
    with compat_mode_suspended(), fake_mode.FakeTensorMode(allow_non_fake_inputs=False) as mode:
        probe = torch.empty(1, device="cuda")
        assert probe.device.type == "cuda"
        yield mode


def _cuda_batch(b: int = 4, s: int = 16):
    dev = torch.device("cuda")
    # no requires_grad: recording autograd on CUDA fake tensors aborts a CPU-only build (the GPU script covers backward)
    lp = torch.empty(b, s, device=dev)
    fields = {k: torch.empty(b, s, device=dev) for k in ("old", "adv", "mask", "weight", "rollout", "ref", "ent")}
    return lp, fields


def test_the_fake_mode_catches_a_cpu_tensor(cuda_fake):
    x = torch.empty(3, device="cuda")
    with pytest.raises(Exception, match="device"):
        x + torch.zeros(3)
    h = torch.zeros(5, dtype=torch.float64)
    with pytest.raises(Exception, match="device"):
        h.index_add_(0, torch.empty(3, dtype=torch.int64, device="cuda"), torch.empty(3, dtype=torch.float64, device="cuda"))


@pytest.mark.parametrize("name", ["ppo", "dual_clip", "cispo"])
def test_policy_objective_and_metrics_stay_on_cuda(cuda_fake, name):
    algo = AlgoConfig.model_validate({"policy_loss": {"name": name, "entropy_coef": 0.01}, "kl": {"coef": 0.1},
                                      "calibration": {"enabled": True}})
    lp, f = _cuda_batch()
    # the clipper's held bounds are host-side state: the objective moves them to the data
    clipper = CalibratedClipper(algo.calibration, eps_low=0.2, eps_high=0.2)
    loss, sums = policy_objective(lp, f["old"], f["adv"], f["weight"], f["mask"], clipper.bounds(),
                                  rollout_logprobs=f["rollout"], ref_logprobs=f["ref"], entropy=f["ent"], cfg=algo)
    assert loss.device.type == "cuda"
    assert sums and all(v.device.type == "cuda" for v in sums.values()), {k: v.device for k, v in sums.items()}


def test_sequence_rollout_correction_and_loss_metrics_on_cuda(cuda_fake):
    from megatron_rl.algo.rollout_correction import rollout_correction

    _, f = _cuda_batch()
    for mode in ("tis", "mis"):
        for level in ("token", "sequence"):
            out = rollout_correction(f["old"], f["rollout"], f["mask"], mode=mode, level=level)
            assert out.weight.device.type == "cuda" and out.clipped.device.type == "cuda"
    lo, hi = CalibratedClipper(CalibrationConfig(enabled=True), eps_low=0.2, eps_high=0.2).bounds(torch.device("cuda"))
    parts = {**M.clip_fraction_sums(f["old"], f["adv"], f["mask"], lo, hi), **M.ratio_histograms(f["old"], f["adv"], f["mask"]),
             **M.mismatch_sums(f["old"], f["rollout"], f["mask"]), **M.masked_mean_sums("x", f["ent"], f["mask"])}
    assert all(v.device.type == "cuda" for v in parts.values())


@pytest.mark.parametrize("backend", ["allgather", "histogram"])
def test_calibration_statistics_accumulate_on_cuda(cuda_fake, backend):
    r = torch.empty(64, device="cuda")
    a = torch.empty(64, device="cuda")
    spec = HistSpec(64, -2.0, 2.0)
    assert local_histogram(r, a, spec).device.type == "cuda"
    assert reference_sums(r, a, eps_low=0.2, eps_high=0.28).device.type == "cuda"
    stats = RatioStats(backend, reference=True, hist_spec=spec, eps_low=0.2, eps_high=0.28)
    for _ in range(3):  # micro-batches add locally
        stats.add(r, a, ratio_hp=r)
    assert stats.reference.device.type == "cuda" and all(p.device.type == "cuda" for p in stats.parts)
