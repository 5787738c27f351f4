"""Helpers for testing distributed code with real processes (used by replicator's own tests):
:func:`run_distributed`, :func:`assert_equivalent` and fault injection."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from replicator.launch.script_launch import launch
from replicator.testing.fault_injection import (
    Fault,
    corrupt_latest_checkpoint,
    delay_rank,
    fail_rank,
    kill_during_save,
    kill_rank,
    latest_checkpoint,
    terminate_rank,
)

__all__ = ["run_distributed", "assert_equivalent", "assert_params_close", "Fault", "kill_rank",
           "terminate_rank", "fail_rank", "delay_rank", "kill_during_save",
           "corrupt_latest_checkpoint", "latest_checkpoint"]

StrategySpec = str | tuple[str, dict[str, Any]]


def run_distributed(fn: Callable[..., Any], world_size: int = 2, args: Sequence[Any] = (),
                    kwargs: dict[str, Any] | None = None, *, timeout_seconds: float = 60.0,
                    max_restarts: int = 0) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` (module-level) in ``world_size`` processes with a real gloo/NCCL
    group and return each rank's result; a rank that raises makes this raise ``WorkerFailedError``.
    Short collective timeouts; workers fork from a forkserver that imported torch once."""
    return launch(fn, num_replicas=world_size, args=args, kwargs=kwargs,
                  timeout_seconds=timeout_seconds, max_restarts=max_restarts,
                  start_method="forkserver")


def _as_tensors(result: Any) -> dict[str, torch.Tensor]:
    if isinstance(result, torch.nn.Module):
        result = result.state_dict()
    if isinstance(result, Mapping):
        return {str(k): torch.as_tensor(v).detach().cpu() for k, v in result.items()}
    if isinstance(result, (list, tuple)):
        return {str(i): torch.as_tensor(v).detach().cpu() for i, v in enumerate(result)}
    raise TypeError("the training function must return a module, a state_dict-like mapping or "
                    f"a list of tensors, got {type(result).__name__}")


def assert_params_close(expected: Any, actual: Any, atol: float = 1e-5, rtol: float = 0.0,
                        label: str = "") -> None:
    """Raise ``AssertionError`` naming each tensor that differs by more than the tolerance."""
    a, b = _as_tensors(expected), _as_tensors(actual)
    if a.keys() != b.keys():
        raise AssertionError(f"{label}different parameter names: only in expected "
                             f"{sorted(a.keys() - b.keys())}, only in actual "
                             f"{sorted(b.keys() - a.keys())}")
    bad = []
    for name in a:
        x, y = a[name].double(), b[name].double()
        if x.shape != y.shape:
            bad.append(f"{name}: shape {tuple(x.shape)} vs {tuple(y.shape)}")
        elif x.numel() and not torch.allclose(x, y, atol=atol, rtol=rtol):
            bad.append(f"{name}: max |diff| {float((x - y).abs().max()):.3g} > atol {atol:g}")
    if bad:
        raise AssertionError(f"{label}parameters differ:\n  " + "\n  ".join(bad))


def _train_under(train_fn: Callable[..., Any], name: str, kwargs: dict[str, Any]) -> Any:
    from replicator.strategies import get_strategy

    return _as_tensors(train_fn(get_strategy(name, **kwargs)))


def assert_equivalent(train_fn: Callable[..., Any],
                      strategies: Sequence[StrategySpec] = ("one_device", "mirrored"),
                      world_size: int = 2, atol: float = 1e-5, rtol: float = 0.0,
                      timeout_seconds: float = 120.0) -> dict[str, dict[str, torch.Tensor]]:
    """Run ``train_fn(strategy)`` (module-level; returns the model or its state_dict) under each
    strategy and compare the parameters, ``one_device`` in one process, the others on
    ``world_size`` workers (rank 0's). ``one_device`` follows the workers onto the CPU where GPUs
    are too few, unless its spec names a device. Returns the parameters per name."""
    results: dict[str, dict[str, torch.Tensor]] = {}
    gpus_for_all = torch.cuda.is_available() and torch.cuda.device_count() >= world_size
    for spec in strategies:
        name, kwargs = (spec, {}) if isinstance(spec, str) else (spec[0], dict(spec[1]))
        n = 1 if name in ("one_device", "onedevice", "default") else world_size
        if n == 1 and not gpus_for_all and "device" not in kwargs:
            kwargs = {**kwargs, "device": "cpu"}
        results[name] = run_distributed(_train_under, n, args=(train_fn, name, kwargs),
                                        timeout_seconds=timeout_seconds)[0]
    names = list(results)
    for other in names[1:]:
        assert_params_close(results[names[0]], results[other], atol=atol, rtol=rtol,
                            label=f"{names[0]} vs {other}: ")
    return results
