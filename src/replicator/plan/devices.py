"""Nominal figures of devices and links (``--device``, ``--link``): the vendors' datasheets,
not measurements (``cpu`` means "hosts like this one", measured). ``mfu``: the fraction of peak a
step reaches; ``overlap``: the share of backward that communication may hide behind (none on
CPUs, whose collectives need the compute's cores)."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["DEVICES", "Device", "Link", "get_device", "parse_duration", "parse_link"]


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU host) type: compute, memory and the links inside its host."""

    name: str
    description: str
    peak_flops: float          # dense bf16/fp16 tensor FLOP/s (fp32 for cpu), nominal
    memory_bytes: float        # per device
    memory_bandwidth: float    # bytes/s, what the optimizer step streams through
    per_host: int              # devices in one host (0: this machine's cores)
    intra_bandwidth: float     # bytes/s one way between devices of a host (NVLink, PCIe)
    intra_alpha: float         # seconds of latency per message inside a host
    mfu: float = 0.4           # fraction of peak a training step reaches
    overlap: float = 1.0       # fraction of backward that hides gradient communication
    measured: bool = False     # True: figures come from measurements on this machine
    peak_flops_tf32: float = 0.0  # TF32 tensor FLOP/s, dense (fp32 models' matmuls, convs)
    peak_flops_fp32: float = 0.0  # plain fp32 FLOP/s (no tensor cores)

    @property
    def is_cpu(self) -> bool:
        return self.measured

    def flops_rate(self, precision: str, tf32_fraction: float = 0.0) -> float:
        """The peak rate in ``precision`` (fp32 on an H100: 67, not 989, TFLOP/s)."""
        if precision == "half" or not self.peak_flops_fp32:
            return self.peak_flops
        f = min(1.0, max(0.0, tf32_fraction))
        tf32 = self.peak_flops_tf32 or self.peak_flops_fp32
        return 1.0 / (f / tf32 + (1.0 - f) / self.peak_flops_fp32)


GB = 1e9

#: The known devices. Sources: NVIDIA A100/H100/H200/V100/A10G datasheets (SXM parts, dense
#: tensor throughput without sparsity, NVLink bandwidth one way; then the TF32 tensor and plain
#: fp32 rates). ``cpu``: hosts like this one.
DEVICES: dict[str, Device] = {
    "cpu": Device("cpu", "hosts like this machine (figures measured here)", 0.0, 0.0, 0.0,
                  0, 0.0, 0.0, mfu=1.0, overlap=0.0, measured=True),
    "v100": Device("v100", "NVIDIA V100 SXM2 32 GB", 125e12, 32 * GB, 900 * GB, 8,
                   150 * GB, 5e-6, peak_flops_tf32=15.7e12, peak_flops_fp32=15.7e12),
    "a10g": Device("a10g", "NVIDIA A10G 24 GB (PCIe, 4 per host)", 70e12, 24 * GB, 600 * GB, 4,
                   16 * GB, 10e-6, peak_flops_tf32=35e12, peak_flops_fp32=31.2e12),
    "a100": Device("a100", "NVIDIA A100 SXM 80 GB", 312e12, 80 * GB, 2039 * GB, 8, 300 * GB,
                   5e-6, peak_flops_tf32=156e12, peak_flops_fp32=19.5e12),
    "h100": Device("h100", "NVIDIA H100 SXM 80 GB", 989e12, 80 * GB, 3350 * GB, 8, 450 * GB,
                   5e-6, peak_flops_tf32=494e12, peak_flops_fp32=67e12),
    "h200": Device("h200", "NVIDIA H200 SXM 141 GB", 989e12, 141 * GB, 4800 * GB, 8, 450 * GB,
                   5e-6, peak_flops_tf32=494e12, peak_flops_fp32=67e12),
}


def get_device(name: str) -> Device:
    """The device called ``name`` (case-insensitive); a clear error lists the known ones."""
    if not isinstance(name, str):
        raise TypeError(f"device must be a name such as 'a100', got {type(name).__name__}")
    device = DEVICES.get(name.strip().lower())
    if device is None:
        raise ValueError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}. "
                         "HINT: --device cpu plans for hosts like this machine; for another "
                         "accelerator pick the nearest one in the list")
    return device


@dataclass(frozen=True)
class Link:
    """A network link between hosts: bandwidth (bytes/s, one way) and latency (seconds)."""

    bandwidth: float
    alpha: float
    text: str = ""

    def __str__(self) -> str:
        return self.text or f"{self.bandwidth * 8 / 1e9:g}gbit"


_PREFIXES = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BIT_UNITS = {p + u: v for p, v in _PREFIXES.items() for u in ("bit", "bps", "bit/s")}
_BYTE_UNITS = {p + "b/s": v for p, v in _PREFIXES.items()}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/]+)\s*$", re.IGNORECASE)

#: Latency of one message between hosts when ``--latency`` is not given: TCP over a
#: datacentre network is tens of microseconds per hop (gloo's own overhead comes on top).
DEFAULT_LINK_ALPHA = 25e-6


def parse_link(text: str, alpha: float | None = None) -> Link:
    """``"25gbit"`` -> a :class:`Link` of 3.125e9 bytes/s; errors say what is accepted."""
    if not isinstance(text, str):
        raise TypeError(f"link must be text such as '25gbit', got {type(text).__name__}")
    accepted = ("HINT: write a positive number and a unit: 25gbit, 100gbit, 200mbit, 400gbps "
                "(bits per second) or 10GB/s, 500MB/s (bytes per second)")
    match = _NUMBER.match(text)
    if match is None:
        if text.strip().startswith("-"):
            raise ValueError(f"link bandwidth {text!r} is negative. {accepted}")
        raise ValueError(f"cannot read the link {text!r}. {accepted}")
    value, unit = float(match.group(1)), match.group(2)
    low = unit.lower()
    if low in _BIT_UNITS:
        bandwidth = value * _BIT_UNITS[low] / 8
    elif low in _BYTE_UNITS:  # 10GB/s: bytes, 10Gb/s: bits
        bandwidth = value * _BYTE_UNITS[low] / (1 if "B" in unit else 8)
    elif low in ("gb", "mb", "kb", "tb"):
        raise ValueError(f"the link unit {unit!r} is ambiguous (bits or bytes?). {accepted}")
    else:
        raise ValueError(f"unknown unit {unit!r} in the link {text!r}. {accepted}")
    if not bandwidth > 0:
        raise ValueError(f"link bandwidth must be positive, got {text!r}. {accepted}")
    return Link(bandwidth, DEFAULT_LINK_ALPHA if alpha is None else alpha, text.strip())


_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}


def parse_duration(text: str) -> float:
    """``"25us"`` -> 2.5e-05 seconds (units s, ms, us, ns); a latency must be >= 0."""
    match = re.match(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(s|ms|us|µs|ns)\s*$", text)
    if match is None:
        raise ValueError(f"cannot read the duration {text!r}. HINT: write a number >= 0 and a "
                         "unit: 25us, 0.1ms, 1e-5s")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]
