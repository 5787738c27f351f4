"""Which host each process runs on: the key that decides what may share memory.

``REPLICATOR_HOST``, else ``TF_CONFIG``'s address, else the hostname and ``GROUP_RANK``; never
the boot id, which namespaces on one machine share. Conservative: a wrong split only costs speed.
Where the environment cannot say, ``hosts=`` declares them: a declared host may split an
environment's host, never join two; parameter servers keep the environment's host.
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


def exchange_host_keys(group: dist.ProcessGroup | None = None,
                       key: str | None = None) -> list[str]:
    """The host key of every process of ``group``, in group-rank order (a collective of fixed-size
    byte tensors, nothing pickled); without a process group, the one local key."""
    key = local_host_key() if key is None else key
    if not dist.is_available() or not dist.is_initialized():
        return [key]
    raw = key.encode()
    if len(raw) > MAX_HOST_KEY_BYTES:
        raise ClusterConfigError(
            f"host key {key[:40]!r}... is {len(raw)} bytes; at most {MAX_HOST_KEY_BYTES}. "
            f"HINT: set {HOST_ENV} to a shorter name for this host.")
    mine = torch.zeros(MAX_HOST_KEY_BYTES + 1, dtype=torch.uint8)  # the length, then the bytes
    mine[0] = len(raw)
    mine[1:1 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    if dist.get_backend(group) == "nccl":
        mine = mine.to(torch.device("cuda", torch.cuda.current_device()))
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return [bytes(p.cpu()[1:1 + int(p[0])].tolist()).decode() for p in parts]


def group_by_host(ranks: Sequence[int], keys: Sequence[str]) -> list[list[int]]:
    """``ranks`` split by host key, hosts in order of their first rank, ranks in given order."""
    if len(ranks) != len(keys):
        raise ValueError(f"{len(ranks)} ranks but {len(keys)} host keys")
    hosts: dict[str, list[int]] = {}
    for rank, key in zip(ranks, keys):
        hosts.setdefault(key, []).append(rank)
    return list(hosts.values())


# -- declared hosts: ``Topology(hosts=N)`` (consecutive ranks) or rank lists ------------------
#: What ``hosts=`` accepts: ``None`` (the environment's hosts), a count, or rank lists.
HostsSpec = int | Sequence[Sequence[int]] | None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_hosts_spec(hosts: object) -> None:
    """Refuse a ``hosts=`` value of the wrong form (no process group needed)."""
    if hosts is None:
        return
    if _is_int(hosts):
        if hosts < 1:  # type: ignore[operator]
            raise ClusterConfigError(
                f"hosts={hosts!r}: a job runs on at least one host. HINT: give the number of "
                "hosts (hosts=2), a list of each host's worker ranks (hosts=[[0, 1], [2, 3]]), "
                "or leave hosts out to take them from the environment")
        return
    ok = isinstance(hosts, Sequence) and not isinstance(hosts, (str, bytes)) and all(
        isinstance(h, Sequence) and not isinstance(h, (str, bytes)) and all(map(_is_int, h))
        for h in hosts)
    if not ok:
        raise ClusterConfigError(
            f"hosts={hosts!r} is neither a number of hosts nor a list of rank lists. HINT: "
            "hosts=2 (consecutive ranks per host) or hosts=[[0, 1], [2, 3]] (each host's "
            "worker ranks)")
    if not hosts:
        raise ClusterConfigError("hosts=[] names no host. HINT: list each host's worker ranks, "
                                 "hosts=[[0, 1], [2, 3]], or leave hosts out")


def declared_groups(hosts: HostsSpec, num_workers: int, num_ps: int = 0) -> list[list[int]]:
    """The worker ranks of each declared host, in the order given (see the module doc);
    raises :class:`ClusterConfigError` with a hint when they do not cover the workers once."""
    check_hosts_spec(hosts)
    if hosts is None:
        raise ValueError("no hosts declared")  # callers read the environment's hosts instead
    processes = f"{num_workers} worker processes" if num_ps else f"{num_workers} processes"
    if isinstance(hosts, int):
        if num_workers % hosts:
            divisors = [d for d in range(1, num_workers + 1) if num_workers % d == 0]
            raise ClusterConfigError(
                f"hosts={hosts} does not divide the job's {processes}; every host runs the "
                f"same number of them. HINT: choose hosts among {divisors}, launch a multiple "
                f"of {hosts} workers, or list each host's ranks (hosts=[[0, 1], [2]])")
        per = num_workers // hosts
        return [list(range(i * per, (i + 1) * per)) for i in range(hosts)]
    groups = [list(h) for h in hosts]
    owner: dict[int, int] = {}
    for i, members in enumerate(groups):
        if not members:
            raise ClusterConfigError(f"hosts={hosts!r}: host {i} has no rank. HINT: leave "
                                     "empty hosts out")
        for rank in members:
            if num_workers <= rank < num_workers + num_ps:
                raise ClusterConfigError(
                    f"hosts={hosts!r} puts rank {rank} on host {i}, but rank {rank} is a "
                    f"parameter server (num_ps={num_ps}: ranks {num_workers}.."
                    f"{num_workers + num_ps - 1}). HINT: hosts= groups the workers (ranks "
                    f"0..{num_workers - 1}); parameter servers keep the environment's host")
            if not 0 <= rank < num_workers:
                raise ClusterConfigError(
                    f"hosts={hosts!r} names rank {rank}, but the job's workers are ranks "
                    f"0..{num_workers - 1}. HINT: list only the ranks of this job's workers")
            if rank in owner:
                raise ClusterConfigError(
                    f"hosts={hosts!r} puts rank {rank} on host {owner[rank]} and on host {i}. "
                    "HINT: a process runs on one host; list each rank once")
            owner[rank] = i
    missing = [r for r in range(num_workers) if r not in owner]
    if missing:
        raise ClusterConfigError(
            f"hosts={hosts!r} leaves worker rank(s) {missing} on no host. HINT: list every "
            f"worker rank 0..{num_workers - 1} once, or give a count (hosts={len(groups)})")
    return groups


def apply_declared_hosts(hosts: HostsSpec, keys: Sequence[str], num_ps: int = 0) -> list[str]:
    """Every process's host key with ``hosts`` declared over the environment's ``keys``."""
    if hosts is None:
        return list(keys)
    num_workers = len(keys) - num_ps
    groups = declared_groups(hosts, num_workers, num_ps)
    out = list(keys)
    for i, members in enumerate(groups):
        seen: dict[str, int] = {}  # each environment host's first rank in this host
        for rank in members:
            seen.setdefault(keys[rank], rank)
        if len(seen) > 1:
            where = ", ".join(f"rank {r} on {k!r}" for k, r in seen.items())
            raise ClusterConfigError(
                f"hosts={hosts!r} puts {where} on one host (host {i}), but the environment "
                "(REPLICATOR_HOST, TF_CONFIG or the launcher's node rank) places them on "
                "different hosts, which share no memory. HINT: a declared host may split an "
                "environment's host, not join two: declare more hosts, or leave hosts= out to "
                "use the environment's")
        for rank in members:
            out[rank] = f"host{i}@{keys[members[0]]}"
    return out


def job_host_keys(hosts: HostsSpec = None, num_ps: int = 0) -> list[str]:
    """Every process's host key, in rank order: the environment's, with ``hosts`` declared
    over them (a collective over the default group: every process, same arguments)."""
    check_hosts_spec(hosts)
    return apply_declared_hosts(hosts, exchange_host_keys(None, local_host_key()), num_ps)
