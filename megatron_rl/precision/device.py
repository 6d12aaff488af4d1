"""What this process's device can run, detected once and passed down: CUDA, compute capability, Transformer Engine.

`detect_device_facts()` is the only place that asks torch and the import system (cached: one answer
per process); everything else takes a `DeviceFacts` argument, so tests inject the facts of a GPU
they do not have and `megatron-rl plan --gpu` builds them from the GPU it is asked about.

Which FP8/FP4 recipe a GPU can run follows Transformer Engine 2.20.2's own checks
(transformer_engine/pytorch/quantization.py: `_compute_fp8_support`, `_compute_fp8_block_scaling_support`,
`_compute_mxfp8_support`, `_compute_nvfp4_support`, used by `check_recipe_support`):

| precision.recipe     | TE recipe              | compute capability                                    |
|----------------------|------------------------|-------------------------------------------------------|
| delayed, tensorwise  | DelayedScaling, Float8CurrentScaling | >= 9.0 (8.9 with cuBLASLt >= 12.1.3 and CUDA >= 12.1) |
| blockwise            | Float8BlockScaling     | >= 9.0 and CUDA >= 12.9                               |
| mxfp8                | MXFP8BlockScaling      | >= 10.0 and < 12.0 ("not supported on 12.0+ architectures yet") |
| nvfp4                | NVFP4BlockScaling      | >= 10.0                                               |
| mxfp4                | (none: CPU emulation)  | never on GPU                                          |

The CUDA / cuBLASLt versions are the GPU machine's own; `precision.te.check_te_recipe_support` asks TE
itself on the real device when the Learner is built. On CPU every recipe is emulated (no GPU, no TE).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

Capability = tuple[int, int]


@dataclass(frozen=True)
class DeviceFacts:
    """The facts the learner's build depends on (CPU: cuda False, capability None, te False)."""

    cuda: bool
    """CUDA is available to this process."""
    capability: Optional[Capability] = None
    """Compute capability (major, minor) of the process's GPU; None without CUDA."""
    te: bool = False
    """transformer_engine.pytorch imports (only asked when CUDA is available)."""
    te_error: str = ""
    """Why Transformer Engine does not import, when it does not ('' otherwise or without CUDA)."""
    apex_wgrad: bool = False
    """apex's fused_weight_gradient_mlp_cuda imports (megatron's non-TE linears need it for gradient_accumulation_fusion)."""

    @property
    def use_te(self) -> bool:
        """True when the learner builds megatron's Transformer Engine spec (CUDA and TE)."""
        return self.cuda and self.te

    def describe(self) -> str:
        """One phrase naming the device, e.g. 'a GPU of compute capability 9.0 with Transformer Engine'."""
        if not self.cuda:
            return "CPU (no CUDA)"
        cc = f"{self.capability[0]}.{self.capability[1]}" if self.capability else "unknown"
        return f"a GPU of compute capability {cc} {'with' if self.te else 'without'} Transformer Engine"


CPU = DeviceFacts(cuda=False)
"""The facts of a machine without CUDA."""


def gpu_facts(capability: Capability, te: bool = True, apex_wgrad: bool = False) -> DeviceFacts:
    """Facts of a GPU known by its capability (plan --gpu, tests): TE assumed installed unless told otherwise."""
    return DeviceFacts(cuda=True, capability=tuple(capability), te=te, apex_wgrad=apex_wgrad)


@functools.lru_cache(maxsize=None)
def detect_device_facts() -> DeviceFacts:
    """This process's facts, asked once (CUDA first: a CPU process never imports Transformer Engine or apex)."""
    import torch

    if not torch.cuda.is_available():
        return CPU
    capability = tuple(torch.cuda.get_device_capability())
    te, te_error = True, ""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising OSError/RuntimeError while loading its library
        te, te_error = False, f"{type(exc).__name__}: {exc}"
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
        apex_wgrad = True
    except Exception:
        apex_wgrad = False
    return DeviceFacts(cuda=True, capability=capability, te=te, te_error=te_error, apex_wgrad=apex_wgrad)


def _cc(capability: Capability) -> str:
    return f"{capability[0]}.{capability[1]}"


def recipe_capability_error(recipe: str, capability: Capability) -> Optional[str]:
    """Why a GPU of `capability` cannot run `recipe` (TE 2.20.2's rules, see the module docstring), None when it can."""
    cc = _cc(capability)
    if recipe == "none":
        return None
    if recipe == "mxfp4":
        return ("precision.recipe=mxfp4 is a CPU emulation: Transformer Engine and megatron-core have no MXFP4 "
                f"training recipe, so no GPU runs it (this one has compute capability {cc}); use nvfp4 on Blackwell")
    if recipe in ("mxfp8", "nvfp4"):
        if capability < (10, 0):
            return (f"precision.recipe={recipe} needs compute capability 10.0 or higher (Blackwell) for Transformer "
                    f"Engine's {recipe.upper()} GEMMs; this GPU has {cc} (Hopper runs blockwise, tensorwise or delayed)")
        if recipe == "mxfp8" and capability >= (12, 0):
            return (f"precision.recipe=mxfp8: Transformer Engine 2.20 does not support MXFP8 on compute capability "
                    f"12.0+ yet (this GPU has {cc}); use blockwise or tensorwise")
        return None
    if recipe == "blockwise" and capability < (9, 0):
        return f"precision.recipe=blockwise needs compute capability 9.0 or higher (and CUDA >= 12.9); this GPU has {cc}"
    if capability < (8, 9):
        return f"precision.recipe={recipe} needs compute capability 8.9 or higher (FP8 tensor cores); this GPU has {cc}"
    return None


def learner_device_errors(precision, facts: DeviceFacts) -> list[str]:
    """Why the learner cannot run `precision` on the device `facts` describes ([] when it can; CPU emulates every recipe)."""
    if not facts.cuda or precision.recipe == "none":
        return []
    if getattr(precision, "ratio_consistent_scales", False):
        return ["precision.ratio_consistent_scales is implemented in the CPU emulation only (precision/scale_book.py; "
                "docs/studies/consistent_scales/TE_NOTE.md says which Transformer Engine mechanism would carry it)"]
    if not facts.te:
        why = f" ({facts.te_error})" if facts.te_error else ""
        return [f"precision.recipe={precision.recipe} runs through Transformer Engine on GPU, which does not import "
                f"here{why}: install transformer-engine (the GPU image has it) or set precision.recipe=none"]
    if facts.capability is None:
        return []
    error = recipe_capability_error(precision.recipe, facts.capability)
    return [error] if error else []


# ---------------------------------------------------------------------------------------------- rollout engines
def engine_requantizes_block_scales(capability: Optional[Capability]) -> bool:
    """True when SGLang on a GPU of `capability` rewrites 128x128 block-FP8 weight scales to UE8M0 (powers of two).

    sglang 0.5.23: layers/deep_gemm_wrapper/configurer.py sets DEEPGEMM_SCALE_UE8M0 when DeepGEMM is enabled
    (SGLANG_ENABLE_JIT_DEEPGEMM, default on, compute capability >= 9.0) on sm100 (or sm120/121);
    model_loader/utils.py should_deepgemm_weight_requant_ue8m0 then asks for the requant, except on sm120
    for dense (non-MoE) GEMMs; layers/quantization/fp8.py Fp8LinearMethod.process_weights_after_loading_block_quant
    calls fp8_utils.requant_block_scale_ue8m0_for_deepgemm for 128x128 blocks (scales not yet marked UE8M0,
    bf16 output, N % 64 == K % 128 == 0), which dequantizes and re-quantizes the weight with ceil-to-UE8M0
    scales (requant_weight_ue8m0, per_block_cast_to_fp8). It runs at load and again after every update
    (model_executor/model_runner_components/weight_updater.py end_weight_update -> postprocess_weights).
    So on sm100 only power-of-two scales survive unchanged in value: the learner must send UE8M0 scales.
    """
    return capability is not None and capability[0] == 10


def rollout_scale_fmt_for(precision, engine_capability: Optional[Capability]) -> str:
    """precision.rollout_scale_fmt made concrete for engines on a GPU of `engine_capability` (None: CPU engines).

    auto -> ue8m0 for blockwise FP8 rollouts served by engines that requantize block scales (sm100), fp32
    otherwise (CPU and embedded engines keep their numbers); an explicit fp32 / ue8m0 stays as given.
    """
    fmt = precision.rollout_scale_fmt
    if fmt != "auto":
        return fmt
    blockwise = precision.rollout_quantization == "fp8-blockwise"
    return "ue8m0" if blockwise and engine_requantizes_block_scales(engine_capability) else "fp32"


def engine_device_errors(precision, engine_capability: Optional[Capability]) -> list[str]:
    """Why engines on a GPU of `engine_capability` would not serve the bits the learner sends ([] when they would).

    An `auto` still unresolved here (a PrecisionConfig built in code, never through load_config) means fp32.
    """
    fmt = precision.rollout_scale_fmt
    if (precision.rollout_quantization == "fp8-blockwise" and fmt in ("fp32", "auto")
            and engine_requantizes_block_scales(engine_capability)):
        unresolved = " (auto left unresolved, which quantizes with fp32 scales)" if fmt == "auto" else ""
        return [f"precision.rollout_scale_fmt={fmt}{unresolved} with fp8-blockwise rollouts on engines of compute capability "
                f"{_cc(engine_capability)}: SGLang requantizes the block scales to UE8M0 for DeepGEMM at load and at "
                "every weight update, so the engines would serve other bits than the learner sent; set "
                "precision.rollout_scale_fmt=ue8m0 (or auto, which chooses it there)"]
    return []
