"""State to bytes and back without pickle: tensors in safetensors, everything else in JSON.

A ``state_dict`` (of a model, an optimizer, a scheduler, RNG states...) is a tree of dicts,
lists and tuples whose leaves are tensors, numbers, strings, booleans and ``None``. The tree is
split into a flat ``{key: tensor}`` mapping, stored as safetensors, and a JSON *structure* in
which each tensor is replaced by a reference to its key; the JSON rides in the safetensors
header's metadata. Loading therefore never runs code from the file: the reader validates a
header and views bytes (``safetensors_io``), and JSON builds only plain containers.

Only plain data is accepted on save; anything else raises a ``TypeError`` naming where it sits.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint import safetensors_io
from replicator.checkpoint.placeholders import refuse_placeholders
from replicator.errors import CheckpointCorruptError, UnsafeCheckpointError

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

    def key_for(self, path: str) -> str:
        key = path or "value"
        n = 1
        while key in self.tensors:
            n += 1
            key = f"{path}#{n}"
        return key

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
        if t.device.type != "cpu":
            t = t.to("cpu")
        key = self.key_for(path)
        self.tensors[key] = t
        return key

    def encode(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, int):
            return int(obj)
        if isinstance(obj, float):
            return float(obj)
        if isinstance(obj, torch.Tensor):
            return {_TAG: "tensor", "key": self.add_tensor(obj, path)}
        if isinstance(obj, torch.dtype):
            return {_TAG: "dtype", "name": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {_TAG: "device", "name": str(obj)}
        numpy_value = _encode_numpy(self, obj, path)
        if numpy_value is not _NOT_NUMPY:
            return numpy_value
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


_NOT_NUMPY = object()


def _encode_numpy(encoder: _Encoder, obj: Any, path: str) -> Any:
    np = _numpy()
    if np is None:
        return _NOT_NUMPY
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind not in "biuf":
            raise TypeError(f"{encoder.label}{_where(path)} is a numpy array of dtype "
                            f"{obj.dtype}; only numeric arrays can be stored")
        key = encoder.add_tensor(torch.from_numpy(np.ascontiguousarray(obj)), path)
        return {_TAG: "ndarray", "key": key}
    if isinstance(obj, np.generic):
        return {_TAG: "npscalar", "dtype": obj.dtype.str, "value": obj.item()}
    return _NOT_NUMPY


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy is a dependency
        return None
    return numpy


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
        np = _numpy()
        return np.dtype(str(obj["dtype"])).type(obj["value"]) if np is not None else obj["value"]
    raise CheckpointCorruptError(f"{label}: unknown entry type {tag!r} in the structure")


def _flatten(state: Any, label: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    encoder = _Encoder(label)
    structure = encoder.encode(state, "")
    text = json.dumps(structure, allow_nan=True, separators=(",", ":"))
    return encoder.tensors, {FORMAT_KEY: FORMAT_VERSION, STRUCTURE_KEY: text}


def flatten(state: Any, label: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A state tree (or a copy already flattened: a ``FrozenState``) as the tensors and
    metadata of one safetensors file (no copy)."""
    if hasattr(state, "tensors") and hasattr(state, "metadata"):
        return dict(state.tensors), dict(state.metadata)
    return _flatten(state, label)


def encode(state: Any, label: str = "state") -> bytes:
    """``state`` (a tree of plain values and tensors) as safetensors bytes (see module doc)."""
    return safetensors_io.to_bytes(*_flatten(state, label))


def write(path: str | Path, state: Any, label: str = "state") -> tuple[int, str]:
    """Write ``state`` to ``path`` as safetensors, fsynced; return (bytes, SHA-256 hex)."""
    return safetensors_io.write_file(path, *_flatten(state, label))


def looks_like_pickle(data: safetensors_io.Buffer) -> bool:
    """True for ``torch.save``'s zip archive or a raw pickle (protocol 2 to 5)."""
    head = bytes(data[:4])
    return head == b"PK\x03\x04" or (head[:1] == b"\x80" and head[1:2] in b"\x02\x03\x04\x05")


def refuse_pickle(data: safetensors_io.Buffer, label: str) -> None:
    """Raise :class:`UnsafeCheckpointError` when ``data`` is a pickle rather than safetensors."""
    if not safetensors_io.is_safetensors(data) and looks_like_pickle(data):
        raise UnsafeCheckpointError(
            f"{label} holds a pickle payload (as written by torch.save or pickle); a backup is "
            "loaded only from safetensors and JSON, so it is refused unread. HINT: never "
            "unpickle checkpoints from an untrusted source; if you trust this file, load it "
            "yourself with torch.load(path, weights_only=True) and save it again.")


def decode(data: safetensors_io.Buffer, label: str = "state") -> Any:
    """Inverse of :func:`encode`; raises on a pickle or on a malformed file, never unpickles.

    Tensors are views of ``data`` when it is mutable (no copy).
    """
    refuse_pickle(data, label)
    tensors, metadata = safetensors_io.read(data, label)
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
