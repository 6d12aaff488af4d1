"""tools/near_bound_decisions.py on synthetic token dumps whose disagreements are known by construction."""
import sys
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import near_bound_decisions  # noqa: E402


def _run(tmp_path: Path, ratio, ratio_hp, adv) -> Path:
    run = tmp_path / "run"
    (run / "calibration").mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"algo": {"policy_loss": {"eps_low": 0.2, "eps_high": 0.28}}}))
    np.savez(run / "calibration" / "step_000000.rank0.npz", ratio=np.asarray(ratio, float),
             ratio_hp=np.asarray(ratio_hp, float), adv=np.asarray(adv, float), minibatch=np.zeros(len(adv), np.int64))
    return run


def test_it_counts_each_precisions_clips_and_the_far_disagreements(tmp_path, monkeypatch, capsys):
    # A < 0 (bound 0.8): FP8 clips alone far from the bound (0.5 vs 1.0), high precision clips alone (1.0 vs 0.5),
    # both clip; A > 0 (bound 1.28): FP8 clips alone just past the bound (1.29 vs 1.2); no-advantage and nan tokens
    # are left out
    run = _run(tmp_path, ratio=[0.5, 1.0, 0.5, 1.29, 0.5, 0.5], ratio_hp=[1.0, 0.5, 0.5, 1.2, 1.0, np.nan],
               adv=[-1, -1, -1, 1, 0, -1])
    r, h, a, lo, hi = near_bound_decisions.load([str(run)])
    assert r.size == 4 and (lo, hi) == (0.2, 0.28)
    monkeypatch.setattr(sys, "argv", ["near_bound_decisions.py", str(run)])
    assert near_bound_decisions.main() == 0
    out = capsys.readouterr().out
    assert "they disagree on 0.75000 (3): 2 clipped by low precision only, 1 by high precision only" in out
    # only the token at 1.29 lies within 0.01 of its bound (log 1.29/1.28 = 0.0078): the two far ones stay outside
    assert "two-sided zone 0.01: 0.2500 of tokens, disagreements outside it 2/3" in out
    # one-sided at 0: the tokens FP8 clips (3 of 4) hold both FP8-only disagreements, not the high-precision-only one
    assert "one-sided zone 0.00: 0.7500 of tokens, disagreements outside it 1/3" in out
