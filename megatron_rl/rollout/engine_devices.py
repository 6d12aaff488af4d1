"""Which devices a running engine holds, learned from the engine itself (its /server_info, its process).

A tensor weight sync hands an engine handles that name the sender's device; SGLang opens a CUDA-IPC handle only
on a GPU its process sees (`_device_from_maybe_uuid`, srt/utils/patch_torch.py) and its scheduler exits on any
other. So before the first bucket the senders check the devices the engine reports, not the ones a launcher or
a layout assumes it was given (an engine started by hand, or by another launcher, may hold other GPUs).

What each engine reports:
- the embedded engine: /server_info "visible_devices" (its --visible-devices; null: it sees every device) and
  "tp_size"; its device names are the learner's (`cpu:<index>`, rollout/colocation.py `device_identity`);
- SGLang 0.5.23: /server_info is its resolved ServerArgs (srt/utils/common.py `build_server_info`): "device",
  "tp_size", "base_gpu_id", "gpu_id_step", but no GPU identity. The GPUs its process sees are its
  CUDA_VISIBLE_DEVICES, read from the process listening on the engine's port on this host (/proc); TP rank r
  runs on visible device base_gpu_id + r * gpu_id_step (SGLang's scheduler launch). When the process cannot be
  read (another PID namespace or user), the devices are unknown (`DevicesUnknown`).
"""
from __future__ import annotations

import os
from typing import Optional, Sequence
from urllib.parse import urlparse


class DevicesUnknown(LookupError):
    """The engine's devices cannot be learned from it (the message says why)."""


def _listening_inodes(port: int) -> set[str]:
    """Socket inodes of TCP sockets listening on `port` (any address) in this network namespace."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    return inodes


def listener_environ(port: int) -> Optional[dict[str, str]]:
    """The environment of the process on this host listening on TCP `port` (None when none can be read)."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
            if not any(os.readlink(f"/proc/{pid}/fd/{fd}") in wanted for fd in fds):
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                raw = f.read()
        except OSError:  # gone, or another user's
            continue
        return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)
    return None


def _cuda_names(visible: Optional[str]) -> list[str]:
    """Device names (as `device_identity` writes them) of a CUDA_VISIBLE_DEVICES value, as this process can map it."""
    import torch

    from megatron_rl.rollout.colocation import device_identity

    own = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible is None:
        if own:
            raise DevicesUnknown("the engine sees every GPU of the host, this process only CUDA_VISIBLE_DEVICES="
                                 + ",".join(own))
        count = torch.cuda.device_count()
        if count == 0:  # a stand-in engine on a CPU host: no device to compare, so the handles go unchecked
            raise DevicesUnknown("the engine sees every GPU of the host, and this process sees none")
        return [device_identity(i) for i in range(count)]
    names = []
    for entry in (d.strip() for d in visible.split(",") if d.strip()):
        if not entry.isdigit():  # GPU-<uuid> / MIG-<uuid>: the UUID is the name
            names.append(entry.removeprefix("GPU-"))
        elif not own:
            names.append(device_identity(int(entry)))
        elif entry in own:
            names.append(device_identity(own.index(entry)))
        else:
            raise DevicesUnknown(f"the engine's GPU {entry} is not visible to this process "
                                 f"(CUDA_VISIBLE_DEVICES={','.join(own)})")
    return names


def visible_devices(url: str, info: dict) -> Optional[tuple[str, ...]]:
    """Every device the engine at `url` can open handles of, from its /server_info `info` (module docstring); None:
    all (an embedded engine without --visible-devices). DevicesUnknown when an SGLang engine's process cannot be
    read on this host."""
    if info.get("engine") == "embedded-cpu" or info.get("device") == "cpu":
        visible = info.get("visible_devices")
        return None if visible is None else tuple(str(d) for d in visible)
    port = urlparse(url).port
    env = listener_environ(port) if port else None
    if env is None:
        raise DevicesUnknown(f"no process listening on port {port} of this host could be read")
    return tuple(_cuda_names(env.get("CUDA_VISIBLE_DEVICES")))


def tp_rank_devices(info: dict, visible: Sequence[str]) -> tuple[str, ...]:
    """The device of each TP rank of an engine that sees `visible`: base_gpu_id + r * gpu_id_step (SGLang's rule)."""
    tp = int(info.get("tp_size") or 1)
    base, step = int(info.get("base_gpu_id") or 0), int(info.get("gpu_id_step") or 1)
    ranks = [base + r * step for r in range(tp)]
    if ranks[-1] >= len(visible):
        raise DevicesUnknown(f"tp_size {tp} from base_gpu_id {base} (step {step}) needs more than the "
                             f"{len(visible)} device(s) it sees ({', '.join(visible)})")
    return tuple(visible[i] for i in ranks)


def mismatch_message(url: str, held: Sequence[str], expected: Sequence[str], what: str) -> str:
    """One error line naming the engine, the devices it holds and the ones `what` would send it handles of."""
    return (f"{what}: engine {url} holds device(s) {', '.join(held)} (its /server_info and process), but the weight "
            f"sync would hand it handles of {', '.join(expected)}; SGLang's scheduler exits on a handle of a device it "
            "does not see (Invalid device_uuid). Start the engine on those devices, or use "
            "rollout.weight_sync.transport=distributed or disk")
