"""Device names: parse, validate against what exists, and pick the backend that serves them."""

from __future__ import annotations

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


def default_device_for(local_rank: int) -> torch.device:
    """One GPU per local process when there are enough, else the CPU."""
    n = available_accelerators()
    return torch.device("cuda", local_rank) if local_rank < n else torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"
