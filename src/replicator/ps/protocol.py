"""The parameter-server protocol: message kinds and the optimizer description on the wire.

A worker talks to each server over one :class:`~replicator.ps.messages.Connection`:

- ``HELLO(a=worker, b=attempt)`` -> ``HELLO`` (a = server index, b = 1 if restored, c = pid,
  variable id = the server's host id);
- ``SHM_ATTACH(version=host id, a=push bytes, b=pull bytes, segment name)`` -> ``SHM_ATTACHED``
  (a = 1, or a = 0 and the reason): payloads then go through the segment
  (:class:`replicator.ps.messages.SharedLane`);
- ``REGISTER(shard id, values)`` (the chief; ignored by a server restored from a checkpoint);
- ``OPTIMIZER(json)``: the optimizer's class and hyperparameters, sent again when they change;
- ``GRAD(shard id, version pulled, gradient)`` ... ``PUSH(a=count, b=pull after)``: an update;
- ``PULL(a=shards expected)`` -> ``VALUE(shard id, version, values)`` ... ``VALUES_END``; a large
  shard's values may come in parts, rows ``c - 1`` on of ``b`` (:func:`.server.value_messages`);
- ``STATS(a=input stream)`` -> ``STATS(json)``: staleness (count, sum, max, histogram), shard
  versions, coordinator task pushes applied and repeated, and (server 0) the stream's claims;
- ``SAVE(a=step, json)`` -> ``SAVED``; ``BYE`` on a clean exit; ``ERROR(text)`` on refusal;
- ``TASK_PUSH(var_id=task id, version=push number, a=count, b=pull after)`` ends a coordinator
  function's update instead of ``PUSH``: each server applies a (task, push) once and answers a
  repeat without applying it (``VALUES_END.b = 1``); with ``staleness=0`` and several servers,
  in two phases: ``GRAD ... TASK_PREPARE(var_id=task, version=push, a=count)`` ->
  ``PREPARED(a=1 kept, 0: an earlier attempt's is held or applied)``, then to every server
  ``TASK_COMMIT(var_id=task, version=push, b=pull after)``, answered as ``TASK_PUSH``;
- sparse tables' shards (``REGISTER`` with ``a=1``) are pulled whole only by ``PULL(c=1)``; a
  ``GRAD`` holds the rows of the ``ROW_IDS(shard id, int64 rows)`` before it (``c=1``) or of this
  connection's last row pull of its shard (``c=2``); ``ROW_IDS`` ... ``PULL_ROWS(last shard id,
  its rows, a=count)`` -> ``VALUE(shard id, version, rows)`` ... ``VALUES_END``;
- server 0 only: ``CLAIM(input stream, a=epoch, b=batches)`` -> ``CLAIMED(a=batch or -1)``;
  a ``PUSH(stream, version=epoch, c=batch+1)`` consumes that claim.
"""

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
