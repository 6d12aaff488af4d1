"""End to end: tiny RL runs with an FP8 KV cache from a warm start whose V is rescaled x1000 (o_proj / 1000: the same
model). At unit scales V saturates the engine's cache and the rollout's log-probs leave the learner's; recalibrated, the
scales follow V and the train-vs-rollout k3 KL stays near the unscaled warm start's FP8 cache's. Resuming continues the
scales identically.

Run: pytest -q tests/test_kv_scales_run.py   (slow: a warm start and six short runs)
"""
from __future__ import annotations

import json
import pickle
import urllib.request
from pathlib import Path

import pytest
import torch

from rl_runs import comparable, tiny_overrides, train, warm_start

pytestmark = pytest.mark.slow
STEPS = 2


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """The shared tiny warm start and its V x 1000 rescaling (written beside it, tokenizer included)."""
    from megatron_rl.study.kv_rescale import rescale_hf_dir

    base = warm_start(tmp_path_factory)
    scaled = tmp_path_factory.mktemp("scaled") / "hf"
    rescale_hf_dir(str(base / "sft" / "hf"), str(scaled), 1000.0)
    return base, scaled


def _run(tmp_path, warm, name: str, *extra: str, hf=None) -> list[dict]:
    base, scaled = warm
    overrides = tiny_overrides(base, f"train.steps={STEPS}", "train.eval_every=0", "train.eval_max_prompts=4", *extra)
    overrides = [o for o in overrides if not o.startswith("model.init_checkpoint=")]
    overrides.append(f"model.init_checkpoint={hf or scaled}")
    return train(tmp_path / name, overrides)


def _k3(rows) -> float:
    return sum(r["mismatch_k3_kl"] for r in rows) / len(rows)


def check_last_sync_is_served(run_dir: Path) -> None:
    """An engine started from the run's last synced checkpoint reports every layer's scales on /get_weights_by_name, and
    they are the ones the final checkpoint's window gives (the scales the run sent after its last step)."""
    from megatron_rl.engine.testing import ThreadedServer
    from megatron_rl.precision.kv_scales import KvScaleTracker, kv_scale_names

    ckpt = sorted((run_dir / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    saved = pickle.loads((ckpt / "rl_state.pkl").read_bytes())["kv_cache_scales"]
    tracker = KvScaleTracker(saved["num_layers"], saved["window"], saved["headroom"], saved["power_of_two"])
    tracker.load_state_dict(saved)
    expect = tracker.scales()
    synced = max((run_dir / "weights").glob("weights_*"), key=lambda p: p.stat().st_mtime)
    with ThreadedServer(str(synced), kv_cache_dtype="fp8_e4m3") as srv:
        for i in range(saved["num_layers"]):
            for j, name in enumerate(kv_scale_names("qwen3", i)):
                req = urllib.request.Request(srv.url + "/get_weights_by_name", data=json.dumps({"name": name}).encode(),
                                             headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    assert json.loads(resp.read()) == pytest.approx(float(expect[i, j]), rel=1e-7), name
    assert float(expect[:, 1].min()) > 1.0, "V x 1000 needs scales above 1"


def test_rescaling_preserves_the_model(warm):
    """The rescaled warm start computes the same logits (float rounding aside) with 1000x larger V."""
    from megatron_rl.engine.generation import load_hf_model
    from megatron_rl.precision.kv_cache import new_kv_cache

    base, scaled = warm
    a, b = load_hf_model(str(base / "sft" / "hf")), load_hf_model(str(scaled))
    ids = torch.tensor([[5, 9, 14, 3, 7, 11]])
    with torch.no_grad():
        ca, cb = new_kv_cache(a.config), new_kv_cache(b.config)
        la, lb = a(ids, cache=ca, use_cache=True).logits, b(ids, cache=cb, use_cache=True).logits
    torch.testing.assert_close(lb, la, atol=1e-3, rtol=1e-4)
    ratio = cb.layers[0].values.abs().max() / ca.layers[0].values.abs().max()
    assert ratio == pytest.approx(1000.0, rel=1e-3)


def test_recalibrated_fp8_kv_beats_unit_scales_on_a_rescaled_warm_start(warm, tmp_path):
    """Recalibrated scales: the engine reports the synced per-layer scales; the k3 KL is far below unit scales' and as
    low as the FP8 cache's own on the unscaled warm start (E4M3's 3 mantissa bits, which no scale removes; the BF16
    cache's own figure is in docs/results.md); on the unscaled warm start recalibrating is no worse than unit
    scales (power-of-two scales: the same rounding)."""
    base, _ = warm
    plain = base / "sft" / "hf"
    # A frozen policy: Adam moves every element by about lr, which the 1000x smaller o_proj of the rescaled model does
    # not survive (the same function, not the same model to train); frozen, both steps measure the warm start itself.
    fp8 = ("precision.kv_cache_dtype=fp8_e4m3", "optim.lr=1e-30")
    k3 = {"recal": _k3(recal := _run(tmp_path, warm, "recal", *fp8, "precision.kv_cache_scales=recalibrate")),
          "unit": _k3(unit := _run(tmp_path, warm, "unit", *fp8, "precision.kv_cache_scales=unit")),
          "plain_recal": _k3(_run(tmp_path, warm, "plain_recal", *fp8, hf=plain)),
          "plain_unit": _k3(_run(tmp_path, warm, "plain_unit", *fp8, "precision.kv_cache_scales=unit", hf=plain))}
    print("k3 KL:", k3)
    assert all("kv_cache/v_scale_max" in r for r in recal) and not any("kv_cache/v_scale_max" in r for r in unit)
    assert recal[-1]["kv_cache/v_amax"] > 448, "V x 1000 is beyond E4M3's range at unit scale"
    check_last_sync_is_served(tmp_path / "recal")
    assert k3["unit"] > 20 * k3["recal"], k3
    # another draw of the same E4M3 rounding (V x1000 moves every V against the grid): 1.0-1.9x of the plain cache's
    # error across seeds and CPUs, so 4x bounds it with margin, still 5x below what unit scales leave (> 20x)
    assert k3["recal"] < 4.0 * k3["plain_unit"] + 1e-4, k3
    # power-of-two scales round every in-range value as 1.0 does (the exact rule's scales drew a 1.25x worse error
    # than unit in the main job's 100-step runs: docs/results.md)
    assert k3["plain_recal"] <= 1.02 * k3["plain_unit"] + 1e-6, k3


def test_resume_continues_the_scales_identically(warm, tmp_path):
    """A recalibrating run resumed from its step-1 checkpoint for step 2 gives the uninterrupted run's step 2: the
    window of measured amax is checkpointed, so the first sync after the resume sends the same scales."""
    import shutil

    fp8 = ("precision.kv_cache_dtype=fp8_e4m3", "optim.lr_decay_style=constant", "checkpoint.save_every=1")
    # the plain warm start: trained at an ordinary lr, the V-rescaled one's first update wrecks it (its o_proj is 1000x
    # smaller than Adam's steps; on some CPUs the health guard then stops the run at step 1 as collapsed toward uniform)
    plain = warm[0] / "sft" / "hf"
    reference = _run(tmp_path, warm, "run", *fp8, "train.steps=3", hf=plain)
    # drop the final checkpoint: the rerun resumes from step 1's and trains step 2 again (one run fewer than
    # stopping a second run after step 1)
    checkpoints = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints][-2:] == ["step_00000001", "step_00000002"]
    shutil.rmtree(checkpoints[-1])
    resumed = _run(tmp_path, warm, "run", *fp8, "train.steps=3", hf=plain)
    assert [r["step"] for r in resumed] == [0, 1, 2]
    ref, got = comparable(reference[2]), comparable(resumed[2])
    assert "kv_cache/v_scale_max" in got
    diff = sorted(k for k in set(ref) | set(got) if ref.get(k) != got.get(k))
    assert not diff, diff[:12]
