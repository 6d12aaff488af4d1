"""Could a cheaper high-precision clip decision forward only the sequences near a clip bound? Reads the token dumps
(tracking.dump_ratios: each token's low- and high-precision ratio and advantage) of runs and prints, token by token,
where the two precisions' clip decisions differ and how many tokens (and so sequences, taking tokens as independent)
a selection by the low-precision ratio's distance to the bound would have to forward to catch those differences.

    python tools/near_bound_decisions.py RUN_DIR [RUN_DIR ...]

The zone is two-sided (|log r_lp - log bound| < delta) or one-sided (low precision clips, or is within delta of
clipping); a decision is the bound of the token's advantage sign (1 - eps_low for A < 0, 1 + eps_high for A > 0).
A forward runs per sequence, so one zone token costs its whole sequence.
"""
from __future__ import annotations

import glob
import sys

import numpy as np
import yaml


def load(runs: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray, float, float]:
    """(ratio_lp, ratio_hp, adv, eps_low, eps_high) over every dumped token with both ratios and a nonzero advantage."""
    parts, eps = [], None
    for run in runs:
        pl = yaml.safe_load(open(f"{run}/config.yaml"))["algo"]["policy_loss"]
        if eps not in (None, (pl["eps_low"], pl["eps_high"])):
            raise SystemExit(f"{run}: eps differs from the other runs'")
        eps = (pl["eps_low"], pl["eps_high"])
        for f in sorted(glob.glob(f"{run}/calibration/step_*.npz")):
            d = np.load(f)
            ok = np.isfinite(d["ratio_hp"]) & (d["adv"] != 0)
            parts.append((d["ratio"][ok], d["ratio_hp"][ok], d["adv"][ok]))
    if not parts:
        raise SystemExit("no ratio dumps (runs need tracking.dump_ratios: true)")
    r, h, a = (np.concatenate([p[i] for p in parts]) for i in range(3))
    return r, h, a, eps[0], eps[1]


def main() -> int:
    """Print the disagreement counts and, per zone width, the share of tokens and sequences a selection forwards."""
    if len(sys.argv) < 2:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    r, h, a, eps_low, eps_high = load(sys.argv[1:])
    neg = a < 0
    bound = np.where(neg, 1 - eps_low, 1 + eps_high)
    clip_lp, clip_hp = np.where(neg, r < bound, r > bound), np.where(neg, h < bound, h > bound)
    dis = clip_lp != clip_hp
    print(f"tokens {r.size} (eps {eps_low}/{eps_high}); low precision clips {clip_lp.mean():.4f}, high precision "
          f"{clip_hp.mean():.4f}; they disagree on {dis.mean():.5f} ({dis.sum()}): {(clip_lp & ~clip_hp).sum()} clipped "
          f"by low precision only, {(clip_hp & ~clip_lp).sum()} by high precision only")
    err = np.abs(np.log(r) - np.log(h))
    print("|log r_lp - log r_hp| quantiles 50/90/99/99.9%:", np.quantile(err, [.5, .9, .99, .999]).round(5))
    two_sided = np.abs(np.log(r) - np.log(bound))
    one_sided = np.where(neg, np.log(r) - np.log(bound), np.log(bound) - np.log(r))  # < 0: low precision clips
    for name, dist, deltas in (("two-sided", two_sided, (0.01, 0.05, 0.1)), ("one-sided", one_sided, (0.0, 0.1, 0.2, 0.5))):
        for delta in deltas:
            zone = dist < delta
            p = zone.mean()
            print(f"{name} zone {delta:4.2f}: {p:.4f} of tokens, disagreements outside it {(dis & ~zone).sum()}/{dis.sum()}; "
                  "sequences to forward " + " ".join(f"L={n}: {1 - (1 - p) ** n:.2f}" for n in (40, 500, 4000)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
