"""Mixed precision as a policy of the strategy: compute in bf16/fp16 under ``torch.autocast``,
keep float32 parameters, gradients, optimizer state and outputs. With a loss scaler,
``policy.step(optimizer)`` agrees across replicas on inf/NaN before stepping or skipping."""

from __future__ import annotations

import contextlib
import math
import types
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from replicator.errors import ReplicatorError


class ReplicaReducer(Protocol):
    """What a policy needs of the strategy it is bound to (every ``rp.Strategy`` has it)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def num_replicas_in_sync(self) -> int: ...

    def reduce(self, op: str, value: Any, axis: int | None = None) -> torch.Tensor: ...

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "mixed_bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "mixed_float16": torch.float16,
           "fp32": torch.float32, "float32": torch.float32}


class MixedPrecision:
    """A mixed-precision policy: ``dtype`` ``"bf16"``, ``"fp16"`` or ``"fp32"`` (Keras' names
    accepted); ``loss_scale`` ``"auto"`` (dynamic for fp16), ``"dynamic"`` (as ``GradScaler``:
    ``init_scale``, ``backoff_factor``, ``growth_interval``), a number or ``None``;
    ``device_type``: autocast's (default: the strategy's device)."""

    def __init__(self, dtype: str | torch.dtype = "bf16", *, loss_scale: str | float | None =
                 "auto", init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 device_type: str | None = None, cast_outputs: bool = True) -> None:
        compute = dtype if isinstance(dtype, torch.dtype) else _DTYPES.get(str(dtype).lower())
        if compute is None or compute not in _DTYPES.values():
            raise ValueError(f"MixedPrecision: unknown dtype {dtype!r}; available: bf16, fp16, "
                             "fp32 (or torch.bfloat16/torch.float16)")
        self.compute_dtype = compute
        if loss_scale == "auto":
            loss_scale = "dynamic" if self.compute_dtype == torch.float16 else None
        if loss_scale is not None and loss_scale != "dynamic":
            if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)) or \
                    not math.isfinite(loss_scale) or loss_scale <= 0:
                raise ValueError(f"MixedPrecision: loss_scale must be 'auto', 'dynamic', a "
                                 f"positive number or None, got {loss_scale!r}")
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1
                and init_scale > 0):
            raise ValueError("MixedPrecision: need growth_factor > 1, 0 < backoff_factor < 1, "
                             "growth_interval >= 1 and init_scale > 0")
        self.dynamic, self.scaling = loss_scale == "dynamic", loss_scale is not None
        self._scale = float(init_scale if self.dynamic else (loss_scale or 1.0))
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self._growth_tracker = int(growth_interval), 0
        self.device_type, self.cast_outputs = device_type, bool(cast_outputs)
        self._strategy: ReplicaReducer | None = None
        self._unscaled: set[int] = set()
        #: steps skipped so far because some replica saw inf/NaN gradients
        self.skipped_steps = 0

    @property
    def enabled(self) -> bool:
        """False for ``"fp32"`` (the policy then changes nothing)."""
        return self.compute_dtype != torch.float32

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a scaler)."""
        return self._scale if self.scaling else 1.0

    def __repr__(self) -> str:
        name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.compute_dtype, "fp32")
        scale = "dynamic" if self.dynamic else (self._scale if self.scaling else None)
        return f"MixedPrecision({name!r}, loss_scale={scale!r})"

    def bind(self, strategy: ReplicaReducer) -> None:
        """Use ``strategy`` for the autocast device and the cross-replica inf/NaN agreement
        (``strategy.scope(precision=...)`` calls this)."""
        if self._strategy is not None and self._strategy is not strategy:
            raise RuntimeError("this MixedPrecision policy is already used by another strategy. "
                               "HINT: create one policy per strategy")
        self._strategy = strategy

    def _device_type(self, module: torch.nn.Module | None = None) -> str:
        if self.device_type is not None:
            return self.device_type
        if self._strategy is not None:
            return self._strategy.device.type
        params = module.parameters() if module is not None else iter(())
        return next((p.device.type for p in params), "cpu")

    def autocast(self, device_type: str | None = None) -> contextlib.AbstractContextManager[Any]:
        """The ``torch.autocast`` context of this policy (a no-op for fp32)."""
        if not self.enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type or self._device_type(), dtype=self.compute_dtype)

    def apply(self, module: torch.nn.Module) -> torch.nn.Module:
        """Make ``module``'s forward run under this policy's autocast (once; returns it). Only
        plain settings and a bound method are kept, so ``copy.deepcopy(module)`` works alike."""
        if not self.enabled or getattr(module, "_replicator_autocast", None) is not None:
            return module
        module._replicator_autocast = (  # type: ignore[assignment]
            self._device_type(module), self.compute_dtype, self.cast_outputs)
        module.forward = types.MethodType(_autocast_forward, module)  # type: ignore
        return module

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (unchanged without a scaler)."""
        return loss * self._scale if self.scaling else loss

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``scale(loss).backward(**kwargs)``."""
        self.scale(loss).backward(**kwargs)

    @staticmethod
    def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [p.grad for group in optimizer.param_groups for p in group["params"]
                if p.grad is not None]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale (before clipping them); once a step."""
        if not self.scaling or id(optimizer) in self._unscaled:
            return
        inv = 1.0 / self._scale
        with torch.no_grad():
            for g in self._grads(optimizer):
                g.mul_(inv)
        self._unscaled.add(id(optimizer))

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether any replica's gradients of ``optimizer`` hold inf/NaN (a collective: every
        replica must call it at the same point)."""
        with torch.no_grad():
            bad = any(not bool(torch.isfinite(g).all()) for g in self._grads(optimizer))
        local = torch.ones(()) if bad else torch.zeros(())
        strategy = self._strategy
        if strategy is None:
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                raise ReplicatorError(
                    f"{self!r} decides on inf/NaN gradients in a job of {dist.get_world_size()} "
                    "processes without a strategy: the replicas could skip different steps and "
                    "drift apart. HINT: give the policy to the strategy, `with "
                    "strategy.scope(precision=policy):`, or call policy.bind(strategy).")
        elif strategy.num_replicas_in_sync > 1:
            local = strategy.reduce("max", local)
        return bool(local.item() > 0)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale, agree across replicas on inf/NaN, then step (``True``) or skip (``False``)
        and update the scale. Without a scaler: ``optimizer.step()``."""
        if not self.scaling:
            optimizer.step()
            return True
        self.unscale_(optimizer)
        self._unscaled.discard(id(optimizer))
        bad = self.found_inf(optimizer)
        if bad:
            self.skipped_steps += 1
        else:
            optimizer.step()
        if self.dynamic and bad:  # GradScaler's rule for the scale
            self._scale, self._growth_tracker = self._scale * self.backoff_factor, 0
        elif self.dynamic:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale, self._growth_tracker = self._scale * self.growth_factor, 0
        return not bad

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state, for checkpoints."""
        return {"scale": self._scale, "growth_tracker": self._growth_tracker,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale, self._growth_tracker = float(state["scale"]), int(state["growth_tracker"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _autocast_forward(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward of a module under a :class:`MixedPrecision` policy: the class's forward
    under ``torch.autocast``, floating outputs of the compute dtype cast back to float32."""
    device_type, dtype, cast = module._replicator_autocast  # type: ignore[misc]
    with torch.autocast(device_type, dtype=dtype):
        out = type(module).forward(module, *args, **kwargs)
    if cast:
        out = tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype == dtype
                       else t, out)
    return out
