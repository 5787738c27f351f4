"""The parameter-server protocol: message kinds (each request, its fields and its answer are
listed in docs/parameter_server.md, "Messages") and the optimizer description on the wire."""

from __future__ import annotations

import json
from typing import Any

import torch

from replicator.cluster.env_names import PS_SHARED_MEMORY_ENV
from replicator.errors import ParameterServerError, ParameterServerLostError

__all__ = ["ParameterServerError", "ParameterServerLostError", "describe_optimizer",
           "build_optimizer", "update_hyperparameters"]

HELLO, REGISTER, OPTIMIZER, GRAD, PUSH, PULL, VALUE, VALUES_END = range(1, 9)
STATS, SAVE, SAVED, BYE, ERROR, REGISTERED, CLAIM, CLAIMED = range(9, 17)
SHM_ATTACH, SHM_ATTACHED, TASK_PUSH, ROW_IDS, PULL_ROWS = range(17, 22)
TASK_PREPARE, PREPARED, TASK_COMMIT = range(22, 25)

#: The rendezvous-store key where server ``index`` publishes its ``host:port`` (within the
#: attempt's prefix); the launcher reads it to tell whether the servers of ``--num-ps`` ran.
SERVER_ADDRESS_KEY = "replicator/ps/address/{index}"

#: Set to ``0`` to keep payloads on the socket between processes of one host.
SHARED_MEMORY_ENV = PS_SHARED_MEMORY_ENV

#: Staleness values 0 .. HISTOGRAM_BINS-2 get their own bin; the last bin counts the rest.
HISTOGRAM_BINS = 64

def _plain(value: Any, key: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ParameterServerError(
                f"optimizer hyperparameter {key!r} is a tensor of {value.numel()} values; a "
                "parameter server takes numbers. HINT: pass a Python number.")
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v, key) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ParameterServerError(
        f"optimizer hyperparameter {key!r} has type {type(value).__name__}, which cannot be "
        "sent to a parameter server. HINT: use numbers, booleans and tuples of numbers.")


_SIMPLE = (bool, int, float, str, type(None))


def optimizer_key(optimizer: torch.optim.Optimizer, group_of: dict[int, int]
                  ) -> tuple[Any, ...] | None:
    """A cheap key that changes whenever :func:`describe_optimizer`'s text would (the JSON
    costs tens of microseconds a step); ``None`` when a hyperparameter is not a plain value
    (a tensor learning rate can change in place), and the text must be made each time."""
    groups = []
    for g in optimizer.param_groups:
        items: list[tuple[Any, ...]] = []
        for k, v in g.items():
            if k == "params":
                continue
            if isinstance(v, tuple) and all(isinstance(x, _SIMPLE) for x in v):
                items.append((k, v))
            elif isinstance(v, _SIMPLE):
                items.append((k, type(v), v))  # 1 and 1.0 and True describe differently
            else:
                return None
        groups.append(tuple(items))
    return (type(optimizer), tuple(groups), tuple(group_of.items()))


def describe_optimizer(optimizer: torch.optim.Optimizer, group_of: dict[int, int]) -> str:
    """JSON naming the optimizer's ``torch.optim`` class and each group's hyperparameters;
    ``group_of`` maps shard ids to group indices."""
    cls = type(optimizer)
    if getattr(torch.optim, cls.__name__, None) is not cls:
        raise ParameterServerError(
            f"{cls.__module__}.{cls.__qualname__} is not a torch.optim optimizer, and a "
            "parameter server builds optimizers only by torch.optim name (nothing is pickled). "
            "HINT: use a torch.optim optimizer such as torch.optim.SGD or torch.optim.Adam.")
    groups = [{k: _plain(v, k) for k, v in g.items() if k != "params"}
              for g in optimizer.param_groups]
    return json.dumps({"class": cls.__name__, "groups": groups,
                       "shard_groups": {str(k): v for k, v in group_of.items()}},
                      sort_keys=True)


def build_optimizer(spec: dict[str, Any], param: torch.nn.Parameter, group: int
                    ) -> torch.optim.Optimizer:
    """A fresh optimizer of the described class over one shard."""
    cls = getattr(torch.optim, str(spec["class"]), None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ParameterServerError(f"unknown optimizer class {spec['class']!r}")
    hyper = dict(spec["groups"][group])
    for key in ("betas", "etas", "step_sizes"):
        if isinstance(hyper.get(key), list):
            hyper[key] = tuple(hyper[key])
    return cls([param], **hyper)


def update_hyperparameters(optimizer: torch.optim.Optimizer, spec: dict[str, Any],
                           group: int) -> None:
    """Apply changed hyperparameters (a learning-rate schedule) to a shard's optimizer."""
    for key, value in spec["groups"][group].items():
        current = optimizer.param_groups[0].get(key)
        if isinstance(current, tuple) and isinstance(value, list):
            value = tuple(value)
        optimizer.param_groups[0][key] = value
