"""Which host each process runs on: the key that decides what may share memory.

The key comes from ``REPLICATOR_HOST`` (to name hosts, e.g. network-namespace test hosts),
else ``TF_CONFIG`` (this task's address), else the hostname joined with the node rank
(``GROUP_RANK``); never the boot id, which namespaces on one machine share. Equal keys may share
memory; the key is conservative (two launcher nodes on one machine are two hosts), which only
costs speed.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from replicator.cluster.env_names import HOST_ENV
from replicator.errors import ClusterConfigError

#: Bytes of a host key on the wire (longer keys are refused with a clear error).
MAX_HOST_KEY_BYTES = 128


def _tf_config_host(raw: str) -> str | None:
    try:
        config = json.loads(raw)
        task = config["task"]
        addresses = list(config["cluster"][task["type"]])
        address = str(addresses[int(task["index"])])
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    host, _, _ = address.rpartition(":")
    return host or None


def local_host_key(env: Mapping[str, str] | None = None) -> str:
    """This process's host key (see the module doc)."""
    env = os.environ if env is None else env
    explicit = env.get(HOST_ENV, "").strip()
    if explicit:
        return explicit
    if env.get("TF_CONFIG"):
        host = _tf_config_host(env["TF_CONFIG"])
        if host:
            return host
    node = env.get("GROUP_RANK", "0") or "0"
    return f"{socket.gethostname()}/node{node}"


def _encode(key: str) -> torch.Tensor:
    raw = key.encode()
    if len(raw) > MAX_HOST_KEY_BYTES:
        raise ClusterConfigError(
            f"host key {key[:40]!r}... is {len(raw)} bytes; at most {MAX_HOST_KEY_BYTES}. "
            f"HINT: set {HOST_ENV} to a shorter name for this host.")
    buf = torch.zeros(MAX_HOST_KEY_BYTES + 1, dtype=torch.uint8)
    buf[0] = len(raw)
    if raw:
        buf[1:1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def _decode(buf: torch.Tensor) -> str:
    n = int(buf[0])
    return bytes(buf[1:1 + n].tolist()).decode()


def exchange_host_keys(group: dist.ProcessGroup | None = None,
                       key: str | None = None) -> list[str]:
    """The host key of every process of ``group``, in group-rank order (a collective of fixed-size
    byte tensors, nothing pickled); without a process group, the one local key."""
    key = local_host_key() if key is None else key
    if not dist.is_available() or not dist.is_initialized():
        return [key]
    size = dist.get_world_size(group)
    mine = _encode(key)
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    mine = mine.to(device)
    parts = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(parts, mine, group=group)
    return [_decode(p.cpu()) for p in parts]


def group_by_host(ranks: Sequence[int], keys: Sequence[str]) -> list[list[int]]:
    """``ranks`` split by host key, hosts in order of their first rank, ranks in given order."""
    if len(ranks) != len(keys):
        raise ValueError(f"{len(ranks)} ranks but {len(keys)} host keys")
    hosts: dict[str, list[int]] = {}
    for rank, key in zip(ranks, keys):
        hosts.setdefault(key, []).append(rank)
    return list(hosts.values())
