"""The state a healing replica group receives from a live peer, gathered without user code
(docs/fault_tolerance.md, "Healing"): tensors and plain values only (``weights_only=True``);
DTensors travel as local shards, each rank healing from its peer rank.
"""

from __future__ import annotations

import gc
import hashlib
import random
from collections.abc import Callable, Sequence
from typing import Any

import torch

from replicator.strategies.live import ReplicaGroupMismatchError
from replicator.strategies.live.exchange import like_param
from replicator.strategies.nest import clone_tree
from replicator.strategies.scope_capture import describe_state, named_state

_DTENSOR = "__local_shard__"


def _is_dtensor(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and callable(getattr(t, "to_local", None))


def named_parameters(modules: Sequence[torch.nn.Module]) -> list[tuple[str, torch.nn.Parameter]]:
    """Every parameter of ``modules``, named ``<module index>.<name>``, each once."""
    found: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            found.setdefault(id(p), (f"{i}.{name}", p))
    return list(found.values())


def fingerprint(modules: Sequence[torch.nn.Module]) -> str:
    """What must be equal across groups: names, shapes and dtypes of parameters and buffers."""
    lines = []
    for i, module in enumerate(modules):
        lines += [f"module {i}: {type(module).__name__}", *describe_state(*named_state(module))]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16] + f" ({len(lines)} entries)"


def _optimizer_key(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> str | None:
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params or any(id(p) not in names for p in params):
        return None
    text = ",".join(names[id(p)] for p in params)
    return f"{type(optimizer).__name__}[{hashlib.sha256(text.encode()).hexdigest()[:12]}]"


def find_optimizers(modules: Sequence[torch.nn.Module]) -> dict[str, torch.optim.Optimizer]:
    """The optimizers alive in this process that step only parameters of ``modules``."""
    names = {id(p): n for n, p in named_parameters(modules)}
    found: dict[str, torch.optim.Optimizer] = {}
    for obj in gc.get_objects():
        # by the type alone: isinstance also reads obj.__class__, and a scan of every live
        # object must not touch attributes (torch.distributed.reduce_op warns on any)
        if issubclass(type(obj), torch.optim.Optimizer):
            key = _optimizer_key(obj, names)
            if key is not None:
                _add_unique(found, key, obj)
    return dict(sorted(found.items()))


def find_schedulers(optimizers: dict[str, torch.optim.Optimizer]) -> dict[str, Any]:
    """The LR schedulers alive in this process over ``optimizers``, keyed by optimizer."""
    owner = {id(o): k for k, o in optimizers.items()}
    found: dict[str, Any] = {}
    base = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    for obj in gc.get_objects():
        if issubclass(type(obj), base) and id(getattr(obj, "optimizer", None)) in owner:
            _add_unique(found, f"{owner[id(obj.optimizer)]}/{type(obj).__name__}", obj)
    return dict(sorted(found.items()))


def _add_unique(found: dict[str, Any], key: str, obj: Any) -> None:
    """``found[key] = obj``, numbering a key already taken (``key#1``, ...)."""
    n = sum(k.startswith(key) for k in found)
    found[key if n == 0 else f"{key}#{n}"] = obj


# -- plain data (weights_only) -----------------------------------------------------------------
def _plain(value: Any) -> Any:
    """A copy of ``value`` with DTensors replaced by their local shards (marked)."""
    return clone_tree(value, lambda t: {_DTENSOR: t.to_local().clone()}  # type: ignore[attr-defined]
                      if _is_dtensor(t) else t.clone())


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with the test extra
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = [str(kind), torch.from_numpy(np.asarray(keys, dtype=np.int64)), int(pos),
                      int(has_gauss), float(cached)]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((int(py[0]), tuple(int(x) for x in py[1]), py[2]))
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def capture(modules: Sequence[torch.nn.Module], progress: dict[str, Any]) -> dict[str, Any]:
    """This process's training state to send to a healing peer (plain data)."""
    optimizers = find_optimizers(modules)
    schedulers = find_schedulers(optimizers)
    return {
        "fingerprint": fingerprint(modules),
        "modules": [_plain(m.state_dict()) for m in modules],
        "optimizers": {k: _plain(o.state_dict()) for k, o in optimizers.items()},
        "schedulers": {k: _plain(s.state_dict()) for k, s in schedulers.items()},
        "rng": _rng_state(),
        "progress": dict(progress),
    }


# -- applying a peer's state -------------------------------------------------------------------
def _load_module(module: torch.nn.Module, state: dict[str, Any]) -> None:
    own = module.state_dict(keep_vars=True)
    plain: dict[str, Any] = {}
    with torch.no_grad():
        for key, value in state.items():
            target = own.get(key)
            if isinstance(value, dict) and _DTENSOR in value:
                if target is None or not _is_dtensor(target):
                    raise KeyError(key)
                target.to_local().copy_(value[_DTENSOR])
            else:
                plain[key] = value
    if plain:
        missing = module.load_state_dict(plain, strict=False)
        absent = [k for k in missing.missing_keys if k not in state]  # local shards are loaded
        if absent or missing.unexpected_keys:
            raise KeyError(", ".join([*absent, *missing.unexpected_keys]))


def apply(state: dict[str, Any], modules: Sequence[torch.nn.Module], who: str,
          check_progress: Callable[[dict[str, Any]], None]) -> None:
    """Load a peer's :func:`capture` into this process; a clear error when the groups differ."""
    mine = fingerprint(modules)
    if state.get("fingerprint") != mine:
        raise ReplicaGroupMismatchError(
            f"{who} built a model that differs from its peer group's (structure "
            f"{mine} here, {state.get('fingerprint')} there), so it cannot heal from it. HINT: "
            "every replica group must run the same script and build the same modules in the "
            "same order; look for code that depends on the group id or on local data")
    check_progress(state.get("progress", {}))
    optimizers = find_optimizers(modules)
    schedulers = find_schedulers(optimizers)
    for kind, sent, local in (("optimizers", state["optimizers"], optimizers),
                              ("LR schedulers", state["schedulers"], schedulers)):
        if sorted(sent) != sorted(local):
            raise ReplicaGroupMismatchError(
                f"{who} has {kind} {sorted(local) or 'none'} but its peer group sends state "
                f"for {sorted(sent) or 'none'}. HINT: create the same optimizers and "
                "schedulers over the same parameters in every group, before the first step")
    for i, (module, module_state) in enumerate(zip(modules, state["modules"])):
        try:
            _load_module(module, module_state)
        except KeyError as exc:
            raise ReplicaGroupMismatchError(
                f"{who}: module {i} ({type(module).__name__}) does not match its peer "
                f"group's state: {exc}") from None
    for key, optimizer in optimizers.items():  # marked local shards become DTensors again
        params = [p for g in optimizer.param_groups for p in g["params"]]
        sent = state["optimizers"][key]
        optimizer.load_state_dict({**sent, "state": {
            index: {name: like_param(params[int(index)], value[_DTENSOR])
                    if isinstance(value, dict) and _DTENSOR in value else value
                    for name, value in entry.items()}
            for index, entry in sent.get("state", {}).items()}})
    for key, scheduler in schedulers.items():
        scheduler.load_state_dict(state["schedulers"][key])
    _set_rng_state(state["rng"])
