"""What a backup holds per rank besides the tracked objects: the states of torch's (CPU and
CUDA), numpy's and Python's generators, as plain data (stored without pickle), so a resumed run
is bit-identical; and the input's position (replayed when the input has no ``state_dict()``).
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """The current states of all global generators of this process."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = {"kind": str(kind), "keys": np.asarray(keys, dtype=np.uint32),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def restore_rng(state: dict[str, Any] | None) -> None:
    """Set the generators from :func:`capture_rng`'s result (``None``: none saved), warning
    about what could not be restored."""
    if state is None:
        return
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
        n = state["numpy"]
        np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), int(n["pos"]),
                             int(n["has_gauss"]), float(n["cached"])))
    if missing:
        warnings.warn(f"random generators not restored: {', '.join(missing)}",
                      RuntimeWarning, stacklevel=3)


def _byte_tensor(value: Any) -> torch.Tensor:
    t = torch.as_tensor(value)
    return t if t.dtype == torch.uint8 else t.to(torch.uint8)


def has_state(obj: Any) -> bool:
    """Whether ``obj`` has ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None))


def epoch_length(dataset: Any) -> int | None:
    """Batches in one epoch of ``dataset``, or ``None`` for an input without ``len()``."""
    try:
        return len(dataset)
    except TypeError:
        return None


def warn_replay(ds: Any, skip: int) -> None:
    """Warn that resuming replays ``skip`` batches of an input whose order may not repeat."""
    holders = (ds, getattr(ds, "sampler", None), getattr(ds, "batch_sampler", None))
    if any(callable(getattr(obj, "set_epoch", None)) for obj in holders):
        return  # the order depends on the epoch only: replaying it is exact, only slower
    warnings.warn(
        f"the input has no state_dict(); resuming replays {skip} batches of this epoch, which "
        "gives the same samples only if its order does not depend on the random state. HINT: "
        "use strategy.distribute_dataset(...), whose input position is saved exactly.",
        RuntimeWarning, stacklevel=3)
