"""Accelerator specifications the plan's memory and time estimates use, with their sources.

Numbers are dense (no structured sparsity) peak Tensor Core throughputs and per-GPU figures from
NVIDIA's public datasheets; networking assumes one 400 Gb/s NDR InfiniBand NIC per GPU, as in
DGX/HGX H100, H200 and B200 systems. `cpu` is a nominal device for the miniature CPU scaling study
(2 cores, fp32): its throughput is a stated assumption, not a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

GIB = 1024**3
"""Bytes per GiB."""


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator model."""

    name: str
    """Short name used on the command line."""
    memory_bytes: int
    """Device memory."""
    bf16_flops: float
    """Dense BF16 Tensor Core peak, FLOP/s."""
    fp8_flops: float
    """Dense FP8 Tensor Core peak, FLOP/s."""
    hbm_bytes_per_s: float
    """Memory bandwidth, bytes/s (bounds decode throughput)."""
    nvlink_bytes_per_s: float
    """Intra-node GPU-to-GPU bandwidth per GPU, bytes/s (one direction)."""
    network_bytes_per_s: float
    """Inter-node bandwidth per GPU, bytes/s (one direction)."""
    source: str
    """Where the numbers come from."""
    compute_capability: Optional[tuple[int, int]] = None
    """CUDA compute capability (major, minor); None for the nominal CPU device (CUDA's table of GPU capabilities)."""


_NDR = 400e9 / 8  # one 400 Gb/s NDR InfiniBand NIC per GPU

DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec("h100", 80 * 10**9, 989e12, 1979e12, 3.35e12, 450e9, _NDR,
                   "NVIDIA H100 Tensor Core GPU datasheet, SXM5: 80 GB HBM3, 3.35 TB/s, BF16 989 TFLOPS and FP8 "
                   "1979 TFLOPS dense (half the with-sparsity figures), NVLink 900 GB/s bidirectional", (9, 0)),
        DeviceSpec("h200", 141 * 10**9, 989e12, 1979e12, 4.8e12, 450e9, _NDR,
                   "NVIDIA H200 Tensor Core GPU datasheet, SXM: 141 GB HBM3e, 4.8 TB/s, same Tensor Core peaks as "
                   "H100 SXM, NVLink 900 GB/s bidirectional", (9, 0)),
        DeviceSpec("b200", 180 * 10**9, 2.25e15, 4.5e15, 8.0e12, 900e9, _NDR,
                   "NVIDIA HGX B200 datasheet, per GPU (8-GPU board figures / 8): 1.44 TB HBM3e -> 180 GB, 64 TB/s -> "
                   "8 TB/s, FP8 72 PFLOPS sparse -> 4.5 PFLOPS dense, BF16 2.25 PFLOPS dense, NVLink 1.8 TB/s bidirectional",
                   (10, 0)),
        DeviceSpec("cpu", 24 * GIB, 50e9, 50e9, 20e9, 5e9, 5e9,
                   "nominal 2-core CPU box for the miniature scaling study (fp32 ~50 GFLOP/s, 20 GB/s memory): "
                   "stated assumptions, not measured"),
    )
}


def get_device(name: str) -> DeviceSpec:
    """The spec named `name` (ValueError listing the known names otherwise)."""
    if name not in DEVICES:
        raise ValueError(f"unknown --gpu {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[name]
