"""A checkpoint file without pickle: a state tree's tensors as safetensors (streamed out, read
as views of the verified bytes), its structure as JSON in the header, so loading never runs code
from the file. Placeholders (a pipeline rank's stand-ins for tensors it does not hold) are refused.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from replicator.checkpoint.atomic import write_durable
from replicator.errors import CheckpointCorruptError, CheckpointError, UnsafeCheckpointError

# -- placeholders: stand-ins for state another rank holds, never saved ------------------------
FIX = ("HINT: call `state = strategy.full_state_dict(model)` on every rank (a collective: it "
       "gathers the stages on the chief) and save `state` on the chief; sharded checkpoints "
       "(rp.BackupAndRestore, replicator.resume.save_sharded) save each rank's part")


class Placeholder(torch.Tensor):
    """A 0-element tensor standing for a parameter or buffer held by another rank."""

    def __reduce_ex__(self, proto: Any) -> Any:  # torch.save pickles tensors through this
        warnings.warn(
            "torch.save of a placeholder: this state dict holds a 0-element stand-in for a "
            "tensor another rank holds (a pipeline stage's parameter), so the file does not "
            f"hold the model and will not load into the one-device model. {FIX}.",
            UserWarning, stacklevel=2)
        return super().__reduce_ex__(proto)


def placeholder(like: torch.Tensor) -> Placeholder:
    """A placeholder with ``like``'s dtype and device (and 0 elements)."""
    empty = torch.empty(0, dtype=like.dtype, device=like.device)
    return torch.Tensor._make_subclass(Placeholder, empty)  # type: ignore[return-value]


def leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, leaf)`` of every leaf of ``tree``, through nested dicts, lists and tuples."""
    items = tree.items() if isinstance(tree, Mapping) else \
        enumerate(tree) if isinstance(tree, (list, tuple)) else None
    if items is None:
        yield prefix, tree
        return
    for key, value in items:
        yield from leaves(value, f"{prefix}.{key}" if prefix else str(key))


def refuse_placeholders(state: Any, where: str) -> None:
    """Raise :class:`CheckpointError` when ``state`` holds placeholders: ``where`` (e.g.
    ``"ModelCheckpoint"``) would save a part of the model as if it were all."""
    found = [k or "(value)" for k, v in leaves(state) if isinstance(v, Placeholder)]
    if not found:
        return
    shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
    raise CheckpointError(
        f"{where}: the state holds {len(found)} placeholder(s) ({shown}): tensors this rank "
        "does not hold (other pipeline stages), so the file would not hold the model and "
        f"would not load into the one-device model. {FIX}.")


# -- the safetensors format (https://github.com/huggingface/safetensors) ----------------------
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


def header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
            ) -> tuple[bytes, list[tuple[str, torch.Tensor]]]:
    # Larger elements first keeps every tensor aligned to its element size.
    order = sorted(tensors.items(), key=lambda kv: (-kv[1].element_size(), kv[0]))
    head: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, t in order:
        refuse_placeholders(t, f"safetensors file: tensor {name!r}")
        if t.dtype not in _NAMES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot hold")
        size = t.numel() * t.element_size()
        head[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, order


def _pieces(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]
            ) -> Iterator[bytes | memoryview]:
    head, order = header(tensors, metadata)
    yield head
    for _, t in order:
        flat = t.detach().reshape(-1)
        view = flat.view(torch.uint8).numpy().data.cast("B") if flat.numel() else memoryview(b"")
        for start in range(0, len(view), _CHUNK):
            yield view[start:start + _CHUNK]


def write_file(path: str | Path, tensors: Mapping[str, torch.Tensor],
               metadata: Mapping[str, str]) -> tuple[int, str]:
    """Write a safetensors file of contiguous CPU tensors, fsynced; return (bytes, SHA-256)."""
    return write_durable(path, _pieces(tensors, metadata))


def to_bytes(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> bytes:
    """The same file as :func:`write_file`, in memory."""
    return b"".join(_pieces(tensors, metadata))


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
        head = json.loads(bytes(data[8:8 + n]))
    except ValueError as exc:
        raise CheckpointCorruptError(f"{label}: its header is not JSON ({exc})") from exc
    if not isinstance(head, dict):
        raise CheckpointCorruptError(f"{label}: its header is not a JSON object")
    metadata = head.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointCorruptError(f"{label}: its metadata is not a map of strings")
    base, end_of_data = 8 + n, len(data) - 8 - n
    buffer = data if isinstance(data, (bytearray, np.ndarray)) else bytearray(data)
    spans: list[tuple[int, int]] = []
    tensors = {name: _tensor(buffer, base, end_of_data, name, entry, label, spans)
               for name, entry in head.items()}
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
    numel = math.prod(shape)
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


# -- state trees -------------------------------------------------------------------------------
FORMAT_KEY = "replicator.format"
STRUCTURE_KEY = "replicator.structure"
FORMAT_VERSION = "1"
_TAG = "__rp__"
#: Leaves JSON holds as they are (exact types: a bool or an int subclass is encoded apart).
_PLAIN = (int, float, str)


class _Encoder:
    def __init__(self, label: str) -> None:
        self.label = label
        self.tensors: dict[str, torch.Tensor] = {}

    def add_tensor(self, tensor: torch.Tensor, path: str) -> str:
        refuse_placeholders(tensor, f"{self.label}{_where(path)}")
        t = tensor.detach()
        if type(t) is not torch.Tensor:
            raise TypeError(
                f"{self.label}{_where(path)} is a {type(t).__name__}, a tensor subclass that "
                "BackupAndRestore cannot store. HINT: sharded (DTensor) state needs "
                "torch.distributed.checkpoint; convert other subclasses to plain tensors in "
                "state_dict().")
        if t.layout != torch.strided:
            raise TypeError(f"{self.label}{_where(path)} is a {t.layout} tensor; only dense "
                            "tensors can be stored. HINT: call .to_dense() in state_dict().")
        key, n = path or "value", 1
        while key in self.tensors:
            n += 1
            key = f"{path}#{n}"
        self.tensors[key] = t.to("cpu")
        return key

    def encode(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, (int, float)):  # an int or float subclass as the plain number
            return int(obj) if isinstance(obj, int) else float(obj)
        if isinstance(obj, torch.Tensor):
            return {_TAG: "tensor", "key": self.add_tensor(obj, path)}
        if isinstance(obj, torch.dtype):
            return {_TAG: "dtype", "name": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {_TAG: "device", "name": str(obj)}
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in "biuf":
                raise TypeError(f"{self.label}{_where(path)} is a numpy array of dtype "
                                f"{obj.dtype}; only numeric arrays can be stored")
            key = self.add_tensor(torch.from_numpy(np.ascontiguousarray(obj)), path)
            return {_TAG: "ndarray", "key": key}
        if isinstance(obj, np.generic):
            return {_TAG: "npscalar", "dtype": obj.dtype.str, "value": obj.item()}
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) for k in obj) and _TAG not in obj:
                return {k: self.encode(v, f"{path}/{k}" if path else k) for k, v in obj.items()}
            return {_TAG: "dict",
                    "items": [[self.encode(k, f"{path}/<key>"),
                               self.encode(v, f"{path}/{k}" if path else str(k))]
                              for k, v in obj.items()]}
        if isinstance(obj, (tuple, list)):
            # a sequence of plain numbers and strings (Python's RNG state: 625 ints) as it is
            items = list(obj) if all(type(v) in _PLAIN for v in obj) else [
                self.encode(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(obj)]
            return {_TAG: "tuple", "items": items} if isinstance(obj, tuple) else items
        raise TypeError(
            f"{self.label}{_where(path)} is a {type(obj).__module__}.{type(obj).__qualname__}; a "
            "backup stores only tensors, numbers, strings, None, lists, tuples and dicts (it never"
            " pickles). HINT: make state_dict() return plain values, e.g. a number or a tensor.")


def _where(path: str) -> str:
    return f"[{path!r}]" if path else ""


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor], label: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, label) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: _decode(v, tensors, label) for k, v in obj.items()}
    if tag in ("tensor", "ndarray"):
        key = obj.get("key")
        if not isinstance(key, str) or key not in tensors:
            raise CheckpointCorruptError(f"{label}: the structure refers to tensor {key!r}, "
                                         "which the file does not hold")
        t = tensors[key]
        return t.numpy() if tag == "ndarray" else t
    if tag == "tuple":
        return tuple(_decode(v, tensors, label) for v in obj["items"])
    if tag == "dict":
        return {_decode(k, tensors, label): _decode(v, tensors, label) for k, v in obj["items"]}
    if tag == "dtype":
        dtype = getattr(torch, str(obj["name"]), None)
        if not isinstance(dtype, torch.dtype):
            raise CheckpointCorruptError(f"{label}: unknown dtype {obj['name']!r}")
        return dtype
    if tag == "device":
        return torch.device(str(obj["name"]))
    if tag == "npscalar":
        return np.dtype(str(obj["dtype"])).type(obj["value"])
    raise CheckpointCorruptError(f"{label}: unknown entry type {tag!r} in the structure")


def flatten(state: Any, label: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A state tree (or a copy already flattened: a ``FrozenState``) as the tensors and
    metadata of one safetensors file (no copy)."""
    if hasattr(state, "tensors") and hasattr(state, "metadata"):
        return dict(state.tensors), dict(state.metadata)
    encoder = _Encoder(label)
    text = json.dumps(encoder.encode(state, ""), allow_nan=True, separators=(",", ":"))
    return encoder.tensors, {FORMAT_KEY: FORMAT_VERSION, STRUCTURE_KEY: text}


def encode(state: Any, label: str = "state") -> bytes:
    """``state`` (a tree of plain values and tensors) as safetensors bytes."""
    return to_bytes(*flatten(state, label))


def refuse_pickle(data: Buffer, label: str) -> None:
    """Raise :class:`UnsafeCheckpointError` when ``data`` is ``torch.save``'s zip or a pickle."""
    head = bytes(data[:4])
    pickled = head == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05")
    if pickled and not is_safetensors(data):
        raise UnsafeCheckpointError(
            f"{label} holds a pickle payload (as written by torch.save or pickle); a backup is "
            "loaded only from safetensors and JSON, so it is refused unread. HINT: never "
            "unpickle checkpoints from an untrusted source; if you trust this file, load it "
            "yourself with torch.load(path, weights_only=True) and save it again.")


def decode(data: Buffer, label: str = "state") -> Any:
    """Inverse of :func:`encode`, never unpickling; tensors view ``data`` when it is mutable."""
    refuse_pickle(data, label)
    tensors, metadata = read(data, label)
    text = metadata.get(STRUCTURE_KEY)
    if text is None:
        return tensors  # a plain safetensors file (e.g. a model state_dict)
    try:
        structure = json.loads(text, parse_constant=_parse_constant)
    except ValueError as exc:
        raise CheckpointCorruptError(f"{label}: its structure is not valid JSON ({exc})") from exc
    return _decode(structure, tensors, label)


def _parse_constant(name: str) -> float:
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}[name]
