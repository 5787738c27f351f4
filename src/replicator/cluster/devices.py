"""Device names: parse, validate against what exists, and pick the backend that serves them."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import torch

from replicator.errors import ClusterConfigError


def available_accelerators() -> int:
    """Number of CUDA devices visible to this process (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def parse_device(spec: str | torch.device | None) -> torch.device:
    """Turn ``"cpu"``, ``"cuda:1"``, ``"/gpu:0"`` (tf style) or a ``torch.device`` into a
    ``torch.device`` that exists on this machine, else raise with the list of what exists."""
    if spec is None:
        return torch.device("cuda", 0) if available_accelerators() else torch.device("cpu")
    if isinstance(spec, torch.device):
        device = spec
    else:
        text = str(spec).strip().lower().lstrip("/").replace("gpu", "cuda")
        text = text.replace("device:", "")
        try:
            device = torch.device(text)
        except RuntimeError:
            raise ClusterConfigError(
                f"{spec!r} is not a device name; use 'cpu' or 'cuda:N'") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        n = available_accelerators()
        index = 0 if device.index is None else device.index
        if index >= n:
            have = ", ".join(f"cuda:{i}" for i in range(n)) or "none"
            raise ClusterConfigError(
                f"device {spec!r} does not exist on this machine (CUDA devices: {have}). "
                "HINT: pass devices=None to use what is there, or 'cpu'.")
        return torch.device("cuda", index)
    raise ClusterConfigError(f"device type {device.type!r} of {spec!r} is not supported; "
                             "use 'cpu' or 'cuda:N'")


def parse_devices(specs: Sequence[str | torch.device] | None) -> list[torch.device] | None:
    if specs is None:
        return None
    if isinstance(specs, (str, torch.device)):
        specs = [specs]
    devices = [parse_device(s) for s in specs]
    if not devices:
        raise ClusterConfigError("devices is empty; pass None to use the default device")
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise ClusterConfigError(f"devices mix {sorted(kinds)}; all replicas must use one kind")
    cuda = [d for d in devices if d.type == "cuda"]
    if len({d.index for d in cuda}) != len(cuda):
        raise ClusterConfigError(f"devices {list(map(str, devices))} name a GPU twice")
    return devices


def default_device_for(local_rank: int, local_world_size: int) -> torch.device:
    """One GPU per local process when each can have one (or ``CUDA_VISIBLE_DEVICES`` names
    one), else the CPU for all: a job never mixes NCCL and gloo ranks."""
    n = available_accelerators()
    if local_world_size <= n:
        return torch.device("cuda", local_rank)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if n == 1 and visible and "," not in visible and not visible.startswith("-"):
        return torch.device("cuda", 0)  # this process was given one GPU of its own
    if n and local_rank == 0:
        print(f"[replicator] {local_world_size} processes on this machine but {n} CUDA "
              f"device(s): every replica computes on the CPU (gloo). HINT: start at most {n} "
              "process(es) per machine to use the GPUs, or pass devices='cpu' to say so.",
              file=sys.stderr, flush=True)
    return torch.device("cpu")


def device_identity(device: torch.device | None) -> str | None:
    """The GPU's UUID (the same in every process), to catch two processes on one GPU before
    NCCL refuses them; ``None`` on the CPU or where it cannot be read."""
    if device is None or device.type != "cuda":
        return None
    try:
        uuid = torch.cuda.get_device_properties(device).uuid
    except (AttributeError, RuntimeError, AssertionError):
        return None
    return f"GPU-{uuid}" if uuid else None
