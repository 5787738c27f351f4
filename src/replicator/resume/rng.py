"""Every random number generator a training step may draw from, captured and restored.

A resumed run is bit-identical only if dropout masks, random augmentations and anything else
random continue from the same generator states on every rank: torch's CPU generator, each CUDA
device's generator (when CUDA is in use), numpy's global generator and Python's ``random``.
States are plain data (tensors, lists, numbers) so they are stored without pickle.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """The current states of all global generators of this process."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = {"kind": str(kind), "keys": np.asarray(keys, dtype=np.uint32),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def restore(state: dict[str, Any]) -> list[str]:
    """Set the generators from :func:`capture`'s result; returns what could not be restored."""
    missing = []
    torch.set_rng_state(_byte_tensor(state["torch"]))
    py = state["python"]
    random.setstate((int(py[0]), tuple(int(x) for x in py[1]), py[2]))
    if "cuda" in state:
        if torch.cuda.is_available():
            cuda = [_byte_tensor(s) for s in state["cuda"]]
            if len(cuda) == torch.cuda.device_count():
                torch.cuda.set_rng_state_all(cuda)
            else:
                missing.append(f"cuda ({len(cuda)} saved generators, "
                               f"{torch.cuda.device_count()} devices now)")
        else:
            missing.append("cuda (CUDA is not available now)")
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), int(n["pos"]),
                             int(n["has_gauss"]), float(n["cached"])))
    return missing


def restore_saved(state: dict[str, Any] | None) -> None:
    """:func:`restore` a backup's states (``None``: none saved), warning about what could not
    be restored."""
    if state is None:
        return
    missing = restore(state)
    if missing:
        warnings.warn(f"random generators not restored: {', '.join(missing)}",
                      RuntimeWarning, stacklevel=4)


def _byte_tensor(value: Any) -> torch.Tensor:
    t = torch.as_tensor(value)
    return t if t.dtype == torch.uint8 else t.to(torch.uint8)
