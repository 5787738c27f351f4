"""Block quantisation of two-level training's outer updates (docs/strategies/diloco.md): int8 or
int4 values with one float32 scale per block, which confines an outlier to its block.

Not a gradient ``Compression``: quantised values cannot be summed by an all-reduce, so payloads
are all-gathered and decoded in rank order (the same bits everywhere); a payload (flat ``uint8``:
packed values, then the scales) has a length fixed by ``numel``, ``bits`` and ``block_size``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

#: Bits per value -> the largest magnitude a value may take after scaling.
LEVELS = {8: 127, 4: 7}
DEFAULT_BLOCK_SIZE = 256


def _check(bits: int, block_size: int) -> None:
    if bits not in LEVELS:
        raise ValueError(f"block quantisation takes bits=8 or bits=4, got {bits!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 \
            or block_size % 2:
        raise ValueError(f"block_size must be an even integer >= 2, got {block_size!r}")


def payload_bytes(numel: int, bits: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes of the payload of ``numel`` values (packed values plus one float32 per block)."""
    _check(bits, block_size)
    blocks = math.ceil(numel / block_size)
    return blocks * block_size * bits // 8 + 4 * blocks


def quantize(values: torch.Tensor, bits: int, block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """``values`` (any float tensor, read flat) as one ``uint8`` payload (see the module doc)."""
    _check(bits, block_size)
    flat = values.detach().reshape(-1).float()
    blocks = math.ceil(flat.numel() / block_size)  # the last one padded with zeros
    rows = torch.nn.functional.pad(flat, (0, blocks * block_size - flat.numel()))
    rows = rows.view(blocks, block_size)
    level = LEVELS[bits]
    scales = rows.abs().amax(dim=1) / level
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(rows / safe.unsqueeze(1)).clamp_(-level, level).to(torch.int16)
    if bits == 8:
        packed = q.to(torch.int8).view(torch.uint8).reshape(-1)
    else:  # two values per byte, each as an unsigned nibble (value + 8)
        nib = (q + 8).to(torch.uint8).view(-1, 2)
        packed = (nib[:, 0] | (nib[:, 1] << 4)).reshape(-1)
    return torch.cat([packed, scales.contiguous().view(torch.uint8)])


def dequantize(payload: torch.Tensor, numel: int, bits: int,
               block_size: int = DEFAULT_BLOCK_SIZE) -> torch.Tensor:
    """The float32 values of a payload made by :func:`quantize` (flat, ``numel`` long)."""
    expected = payload_bytes(numel, bits, block_size)
    if payload.dtype != torch.uint8 or payload.numel() != expected:
        raise ValueError(f"a {bits}-bit payload of {numel} values is {expected} uint8 bytes, got "
                         f"{payload.numel()} of {payload.dtype}. HINT: every rank must quantise "
                         "the same number of values with the same bits and block_size")
    blocks = math.ceil(numel / block_size)
    value_bytes = blocks * block_size * bits // 8
    scales = payload[value_bytes:].clone().view(torch.float32)
    packed = payload[:value_bytes]
    if bits == 8:
        q = packed.view(torch.int8).to(torch.float32)
    else:
        low = (packed & 0x0F).to(torch.int16) - 8
        high = (packed >> 4).to(torch.int16) - 8
        q = torch.stack([low, high], dim=1).reshape(-1).to(torch.float32)
    out = q.view(blocks, block_size) * scales.unsqueeze(1)
    return out.reshape(-1)[:numel]


class BlockQuantizer:
    """Quantise to ``bits`` (8 or 4) with a scale per ``block_size`` values, with error feedback
    per ``key``."""

    def __init__(self, bits: int = 8, block_size: int = DEFAULT_BLOCK_SIZE, *,
                 error_feedback: bool = False) -> None:
        _check(bits, block_size)
        self.bits = bits
        self.block_size = block_size
        self.error_feedback = bool(error_feedback)
        self._residuals: dict[str, torch.Tensor] = {}

    def __repr__(self) -> str:
        return (f"BlockQuantizer(bits={self.bits}, block_size={self.block_size}, "
                f"error_feedback={self.error_feedback})")

    def encode(self, values: torch.Tensor, key: str = "") -> torch.Tensor:
        """The payload of ``values`` (flat), plus ``key``'s kept error under error feedback."""
        flat = values.detach().reshape(-1).float()
        if self.error_feedback:
            residual = self._residuals.get(key)
            if residual is not None and residual.numel() == flat.numel():
                flat = flat + residual.to(flat.device)
        payload = quantize(flat, self.bits, self.block_size)
        if self.error_feedback:
            self._residuals[key] = flat - self.decode(payload, flat.numel())
        return payload

    def decode(self, payload: torch.Tensor, numel: int) -> torch.Tensor:
        return dequantize(payload, numel, self.bits, self.block_size)

    def decode_sum(self, payloads: Sequence[torch.Tensor], numel: int) -> torch.Tensor:
        """The float32 sum of ``payloads`` decoded in the order given (the same bits on every member
        that gathered them in that order); an all-zero payload (a member sitting out) adds zeros."""
        if not payloads:
            raise ValueError("decode_sum needs at least one payload. HINT: gather the payloads "
                             "of every member of the exchange first")
        total = torch.zeros(numel, dtype=torch.float32, device=payloads[0].device)
        for payload in payloads:
            total.add_(self.decode(payload, numel))
        return total

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The kept errors by key (copies)."""
        return {k: v.clone() for k, v in self._residuals.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._residuals = {str(k): v.clone() for k, v in state.items()}
