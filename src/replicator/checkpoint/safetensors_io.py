"""The safetensors file format, written by streaming and read without copies.

Format (https://github.com/huggingface/safetensors): 8 bytes little-endian header length N,
N bytes of JSON header (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, ...,
"__metadata__": {str: str}}``, padded with spaces to a multiple of 8), then the raw tensor
bytes. Files written here load with ``safetensors.torch.load_file`` and vice versa.

Why not ``safetensors.torch.save``/``load``: they build the whole file as one ``bytes`` object
and copy every tensor once more on load. Writing tensor by tensor straight to the file, hashing
as it goes, and loading tensors as views of the verified buffer halves the memory traffic of a
large checkpoint. The reader validates every header field (dtype, shape, bounds, overlaps)
before touching data; it never evaluates anything from the file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from replicator.checkpoint.atomic import OverlappedHasher
from replicator.checkpoint.placeholders import refuse_placeholders
from replicator.errors import CheckpointCorruptError

_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _DTYPES[_name] = getattr(torch, _attr)
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000
#: What the reader accepts: file bytes, or the numpy buffer ``read_and_hash`` fills.
Buffer = bytes | bytearray | memoryview | np.ndarray
_CHUNK = 16 << 20


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
            ) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    # Larger elements first keeps every tensor aligned to its element size.
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in order:
        refuse_placeholders(t, f"safetensors file: tensor {name!r}")
        if t.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, order


def _as_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def _stream(f: BinaryIO, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str],
            hasher: OverlappedHasher | hashlib._Hash) -> int:
    head, order = _header(tensors, metadata)
    f.write(head)
    hasher.update(head)
    total = len(head)
    for _, t in order:
        view = _as_bytes(t)
        for start in range(0, len(view), _CHUNK):
            part = view[start:start + _CHUNK]
            hasher.update(part)  # hashed on a helper thread while this chunk is written
            f.write(part)
        total += len(view)
    return total


def write_file(path: str | Path, tensors: Mapping[str, torch.Tensor],
               metadata: Mapping[str, str]) -> tuple[int, str]:
    """Write a safetensors file, flush and fsync it; return (bytes, SHA-256 hex).

    Tensors must be contiguous CPU tensors. A partial file is removed when writing fails.
    """
    hasher = OverlappedHasher()
    try:
        with open(path, "wb") as f:
            size = _stream(f, tensors, metadata, hasher)
            digest = hasher.hexdigest()
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        Path(path).unlink(missing_ok=True)
        raise
    finally:
        hasher.close()
    return size, digest


def to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """The same file as :func:`write_file`, in memory."""
    import io

    buf = io.BytesIO()
    _stream(buf, tensors, metadata, hashlib.sha256())
    return buf.getvalue()


def is_safetensors(data: Buffer) -> bool:
    """True when ``data`` starts like a safetensors file (a sane header length, then ``{``)."""
    if len(data) < 10:
        return False
    n = int.from_bytes(bytes(data[:8]), "little")
    return 2 <= n <= min(MAX_HEADER_BYTES, len(data) - 8) and bytes(data[8:9]) == b"{"


def read(data: Buffer, label: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Parse safetensors ``data``; tensors are views of ``data`` (copied when misaligned or
    when ``data`` is immutable ``bytes``). Raises :class:`CheckpointCorruptError` on any flaw."""
    if not is_safetensors(data):
        raise CheckpointCorruptError(f"{label} is not a safetensors file (truncated or bad "
                                     f"header, {len(data)} bytes)")
    n = int.from_bytes(bytes(data[:8]), "little")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError as exc:
        raise CheckpointCorruptError(f"{label}: its header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointCorruptError(f"{label}: its header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointCorruptError(f"{label}: its metadata is not a map of strings")
    base, end_of_data = 8 + n, len(data) - 8 - n
    buffer = data if isinstance(data, (bytearray, np.ndarray)) else bytearray(data)
    spans: list[tuple[int, int]] = []
    tensors: dict[str, torch.Tensor] = {}
    for name, entry in header.items():
        tensors[name] = _tensor(buffer, base, end_of_data, name, entry, label, spans)
    spans.sort()
    for (_, e0), (b1, _) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointCorruptError(f"{label}: tensors overlap in the file")
    return tensors, dict(metadata)


def _tensor(buffer: bytearray | np.ndarray, base: int, end_of_data: int, name: str, entry: object,
            label: str, spans: list[tuple[int, int]]) -> torch.Tensor:
    where = f"{label}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise CheckpointCorruptError(f"{where} has no description")
    dtype = _DTYPES.get(entry.get("dtype"))  # type: ignore[arg-type]
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if dtype is None:
        raise CheckpointCorruptError(f"{where} has unknown dtype {entry.get('dtype')!r}")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointCorruptError(f"{where} has a malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= end_of_data):
        raise CheckpointCorruptError(f"{where} has data offsets {offsets!r} outside the file")
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty(0, dtype=dtype).element_size()
    begin, end = offsets
    if end - begin != numel * itemsize:
        raise CheckpointCorruptError(f"{where}: shape {shape} needs {numel * itemsize} bytes, "
                                     f"the file gives {end - begin}")
    spans.append((begin, end))
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    start = base + begin
    if start % itemsize:
        raw = torch.frombuffer(bytearray(buffer[start:start + end - begin]), dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)
    return torch.frombuffer(buffer, dtype=dtype, count=numel, offset=start).reshape(shape)
