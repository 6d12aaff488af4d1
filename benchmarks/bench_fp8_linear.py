"""Cost of the emulated-FP8 and FP4 linears relative to a plain linear (forward + backward), every recipe, one run.

    PYTHONPATH=. python benchmarks/bench_fp8_linear.py [--tokens 512] [--hidden 1024] [--out 1024] [--repeats 5]

Prints a table of median times and the ratio to the plain fp32 linear measured side by side in the
same process (interleaved, so machine load affects both alike). No asserts: it reports.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_rl.config.precision import PrecisionConfig
from megatron_rl.precision.linear import fake_quant_linear, make_quantizer

VARIANTS = [
    ("delayed", "hybrid", False),
    ("tensorwise", "hybrid", False),
    ("blockwise", "hybrid", False),
    ("blockwise", "hybrid", True),
    ("mxfp8", "hybrid", False),
    ("tensorwise", "e4m3", False),
    ("nvfp4", "", False),
    ("mxfp4", "", False),
]
FP4_OPTIONS = {"nvfp4": [("", {}), (" no-RHT no-SR", {"fp4_hadamard_wgrad": False, "fp4_stochastic_rounding": False})],
               "mxfp4": [("", {})]}
"""FP4 variants: the default recipe (wgrad Hadamard + stochastic rounding) and nvfp4 without both."""


def _fwd_bwd(fn, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> float:
    """Seconds for one forward + backward."""
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    t0 = time.perf_counter()
    fn(xg, wg).backward(dy)
    return time.perf_counter() - t0


def main() -> None:
    """Measure and print."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--out", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g)
    w = torch.randn(args.out, args.hidden, generator=g) * 0.02
    dy = torch.randn(args.tokens, args.out, generator=g) * 1e-3

    plain = lambda a, b: torch.nn.functional.linear(a, b)  # noqa: E731
    fns = {"plain fp32": plain}
    for recipe, fmt, pow2 in VARIANTS:
        for suffix, extra in FP4_OPTIONS.get(recipe, [("", {"fp8_format": fmt, "power_of_two_scales": pow2})]):
            quant = make_quantizer(PrecisionConfig(recipe=recipe, **extra))
            name = (f"{recipe} {fmt}" + (" pow2" if pow2 else "")).strip() + suffix
            fns[name] = lambda a, b, q=quant: fake_quant_linear(a, b, None, q)

    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        _fwd_bwd(fn, x, w, dy)
    for _ in range(args.repeats):
        for name, fn in fns.items():  # interleaved: load drifts hit every variant alike
            times[name].append(_fwd_bwd(fn, x, w, dy))

    base = statistics.median(times["plain fp32"])
    print(f"fwd+bwd of a [{args.tokens} x {args.hidden}] @ [{args.hidden} x {args.out}] linear, "
          f"median of {args.repeats}, torch threads={torch.get_num_threads()}")
    print(f"{'variant':<24}{'ms':>10}{'x plain':>10}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<24}{med * 1e3:>10.2f}{med / base:>10.2f}")


if __name__ == "__main__":
    main()
