"""Python values on the wire without pickle: a JSON skeleton and the tensors it refers to
(scheduled functions' arguments and results); anything else is refused with its type named."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from replicator.errors import ParameterServerError

#: Resolves a per-worker resource's number to the worker's own object.
Resolver = Callable[[int], Any]


class ResourceRef:
    """A per-worker resource by number (each worker resolves it to its own object)."""

    def __init__(self, number: int) -> None:
        self.number = number

    def __repr__(self) -> str:
        return f"ResourceRef({self.number})"


def encode(value: Any, what: str) -> tuple[str, list[torch.Tensor]]:
    """``value`` as JSON text and its tensors; ``what`` names it in errors."""
    tensors: list[torch.Tensor] = []

    def walk(v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, torch.Tensor):
            tensors.append(v.detach().cpu().contiguous())
            return {"t": len(tensors) - 1}
        if isinstance(v, ResourceRef):  # per-worker values too
            return {"r": v.number}
        if isinstance(v, (list, tuple)):
            return {"l" if isinstance(v, list) else "u": [walk(x, f"{path}[{i}]")
                                                          for i, x in enumerate(v)]}
        if isinstance(v, dict):
            bad = [k for k in v if not isinstance(k, str)]
            if bad:
                raise ParameterServerError(f"{what}{path} is a dict with key {bad[0]!r}; only "
                                           "string keys travel. HINT: use string keys.")
            return {"d": {k: walk(x, f"{path}[{k!r}]") for k, x in v.items()}}
        raise ParameterServerError(
            f"{what}{path} has type {type(v).__name__}, which cannot travel between the "
            "coordinator and a worker (nothing is pickled). HINT: pass tensors, numbers, "
            "strings, None, per-worker iterators, or lists, tuples and dicts of them; build "
            "other objects inside the function.")

    return json.dumps(walk(value, "")), tensors


def decode(text: str, tensors: list[torch.Tensor], resolve: Resolver | None = None) -> Any:
    """The value :func:`encode` took apart; ``resolve`` turns resource numbers into objects."""

    def walk(v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        if "t" in v:
            return tensors[v["t"]]
        if "r" in v:
            if resolve is None:
                return ResourceRef(v["r"])
            return resolve(v["r"])
        if "l" in v:
            return [walk(x) for x in v["l"]]
        if "u" in v:
            return tuple(walk(x) for x in v["u"])
        return {k: walk(x) for k, x in v["d"].items()}

    return walk(json.loads(text))
