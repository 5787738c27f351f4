"""Cluster resolvers: a launcher's description of the job (torchrun, TF_CONFIG, SLURM) as a
:class:`ClusterSpec`; worker 0 (or TF_CONFIG's ``chief``) is rank 0, which hosts the store."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from replicator.cluster.env_names import LAUNCHER_ENV, RESTART_COUNT_ENV, STORE_HOSTED_ENV
from replicator.cluster.ports import DEFAULT_MASTER_PORT
from replicator.errors import ClusterConfigError


@dataclass(frozen=True)
class ClusterSpec:
    """The position of this process in the job, as resolved or given to pin it
    (``ClusterSpec(rank=2, world_size=4, master_port=29500)``); rank 0 hosts the store."""

    rank: int
    world_size: int
    local_rank: int = -1
    local_world_size: int = 1
    node_rank: int = -1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    restart_count: int = 0
    store_is_hosted: bool = False
    source: str = "explicit"
    role: str = "worker"
    #: ``host:port`` of every rank where the source names them (TF_CONFIG), for error messages.
    addresses: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ClusterConfigError(f"ClusterSpec.{name} must be an integer, got {value!r}")
        if self.world_size < 1:
            raise ClusterConfigError(f"ClusterSpec: world_size={self.world_size}; the world "
                                     "needs at least one replica")
        if not 0 <= self.rank < self.world_size:
            raise ClusterConfigError(f"ClusterSpec: rank={self.rank} is outside "
                                     f"0..{self.world_size - 1} (world_size={self.world_size})")
        if self.local_world_size < 1:
            raise ClusterConfigError(f"ClusterSpec: local_world_size={self.local_world_size} "
                                     "must be at least 1")
        if self.local_rank == -1:
            object.__setattr__(self, "local_rank", self.rank % self.local_world_size)
        if self.node_rank == -1:
            object.__setattr__(self, "node_rank", self.rank // self.local_world_size)
        if not 0 <= self.local_rank < self.local_world_size:
            raise ClusterConfigError(f"ClusterSpec: local_rank={self.local_rank} is outside "
                                     f"0..{self.local_world_size - 1}")
        if self.world_size > 1 and self.master_port is None:
            raise ClusterConfigError(
                f"ClusterSpec: master_port is not set but world_size={self.world_size}. HINT: "
                "give the chief's rendezvous port, the same on every process.")

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))

    def resolve(self, env: Mapping[str, str] | None = None) -> ClusterSpec:
        """A spec is its own resolver (so it can be passed as ``cluster_resolver``)."""
        return self


@runtime_checkable
class ClusterResolver(Protocol):
    """Anything that says where this process stands in the job."""

    def resolve(self, env: Mapping[str, str] | None = None) -> ClusterSpec: ...


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ClusterConfigError(f"environment variable {name} is not set. HINT: launch with "
                                     "`replicator run --nproc N script.py` or `torchrun`.")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ClusterConfigError(f"environment variable {name}={raw!r} is not an integer") from None


class TorchrunResolver:
    """The variables ``torchrun``, ``replicator run`` and ``rp.launch`` export (``RANK``, ...)."""

    def resolve(self, env: Mapping[str, str] | None = None) -> ClusterSpec:
        env = os.environ if env is None else env
        world = _int(env, "WORLD_SIZE")
        rank = _int(env, "RANK")
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        local_rank = _int(env, "LOCAL_RANK", rank % max(local_world, 1))
        if world < 1:
            raise ClusterConfigError(f"WORLD_SIZE={world}: the world needs at least one replica")
        if not 0 <= rank < world:
            raise ClusterConfigError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
        if not 0 <= local_rank < max(local_world, 1):
            raise ClusterConfigError(f"LOCAL_RANK={local_rank} is outside 0..{local_world - 1}")
        launcher = env.get(LAUNCHER_ENV)
        hosted = env.get(STORE_HOSTED_ENV) == "1" or \
            env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        port = _int(env, "MASTER_PORT", 0) or None
        if world > 1 and port is None:
            raise ClusterConfigError("MASTER_PORT is not set but WORLD_SIZE > 1")
        return ClusterSpec(
            rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
            node_rank=_int(env, "GROUP_RANK", rank // max(local_world, 1)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
            restart_count=_restart_count(env), store_is_hosted=hosted,
            source=("local-launcher" if launcher == "local" else f"replicator-{launcher}")
            if launcher else ("torchrun" if "TORCHELASTIC_RUN_ID" in env else "environment"),
        )


def _restart_count(env: Mapping[str, str]) -> int:
    return _int(env, RESTART_COUNT_ENV, _int(env, "TORCHELASTIC_RESTART_COUNT", 0))


def _split_address(address: str, what: str) -> tuple[str, int]:
    host, _, port = str(address).rpartition(":")
    if not host or not port.isdigit():
        raise ClusterConfigError(f"{what} address {address!r} is not host:port. HINT: write "
                                 "each task as \"hostname:port\", e.g. \"10.0.0.1:2222\".")
    return host.strip("[]"), int(port)


class TFConfigResolver:
    """``TF_CONFIG`` (or ``tf_config``): ranks follow the worker list, the chief first."""

    def __init__(self, tf_config: str | Mapping | None = None) -> None:
        self.tf_config = tf_config

    def resolve(self, env: Mapping[str, str] | None = None) -> ClusterSpec:
        env = os.environ if env is None else env
        raw = self.tf_config if self.tf_config is not None else env.get("TF_CONFIG", "")
        try:
            config = json.loads(raw) if isinstance(raw, str) else dict(raw)
            cluster = config["cluster"]
            chiefs = [str(a) for a in cluster.get("chief", [])]
            workers = chiefs + [str(a) for a in cluster.get("worker", [])]
            task = config["task"]
            role, index = str(task["type"]), int(task["index"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ClusterConfigError(
                f"TF_CONFIG is not a valid cluster description ({exc!r}); expected "
                '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", '
                '"index": 0}}') from None
        others = sorted(set(cluster) - {"chief", "worker"})
        if others:
            raise ClusterConfigError(
                f"TF_CONFIG has task types {others}; replicator runs synchronous data "
                "parallelism with a chief and workers only. HINT: list every process under "
                "\"worker\" (parameter servers and evaluators are not supported).")
        if len(chiefs) > 1:
            raise ClusterConfigError(f"TF_CONFIG lists {len(chiefs)} chiefs; at most one")
        if not workers:
            raise ClusterConfigError("TF_CONFIG lists no workers")
        if role not in ("chief", "worker"):
            raise ClusterConfigError(f"TF_CONFIG task type {role!r} is not 'chief' or 'worker'")
        rank = index if role == "chief" else len(chiefs) + index
        count = len(chiefs) if role == "chief" else len(workers) - len(chiefs)
        if not 0 <= index < count:
            raise ClusterConfigError(
                f"TF_CONFIG task {dict(task)} is not among the cluster's workers (there are "
                f"{count} {role} entries, index 0..{count - 1}). HINT: the task index must be "
                "this process's position in the list.")
        duplicates = sorted({a for a in workers if workers.count(a) > 1})
        if duplicates:
            raise ClusterConfigError(f"TF_CONFIG lists the address(es) {duplicates} more than "
                                     "once; every process needs its own host:port")
        hosts = [_split_address(a, "TF_CONFIG")[0] for a in workers]
        order = list(dict.fromkeys(hosts))
        mine = hosts[rank]
        same_host = [r for r, h in enumerate(hosts) if h == mine]
        master, port = _split_address(workers[0], "TF_CONFIG")
        return ClusterSpec(rank=rank, world_size=len(workers), local_rank=same_host.index(rank),
                           local_world_size=len(same_host), node_rank=order.index(mine),
                           master_addr=master, master_port=port, restart_count=_restart_count(env),
                           source="tf_config", role=role, addresses=tuple(workers))


_BRACKET = re.compile(r"^(.*?)\[([^\]]+)\](.*)$")


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ClusterConfigError(f"SLURM node list {text!r} has unbalanced brackets")
    return [p.strip() for p in [*parts, text[start:]] if p.strip()]


def _expand_one(name: str) -> list[str]:
    match = _BRACKET.match(name)
    if not match:
        return [name]
    prefix, ranges, rest = match.groups()
    out = []
    for item in ranges.split(","):
        lo, _, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ClusterConfigError(f"SLURM node list range {item!r} in {name!r} is not N or N-M")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(_expand_one(f"{prefix}{n:0{width}d}{rest}"))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """``"node[01-03,07],gpu-a1"`` -> ``["node01", "node02", "node03", "node07", "gpu-a1"]``."""
    return [host for part in _split_top_level(nodelist) for host in _expand_one(part)]


class SlurmResolver:
    """An ``srun`` step: one process per task, the chief on the first node; port: ``MASTER_PORT``,
    else ``port`` (29500)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port

    def resolve(self, env: Mapping[str, str] | None = None) -> ClusterSpec:
        env = os.environ if env is None else env
        rank = _int(env, "SLURM_PROCID")
        world = _int(env, "SLURM_NTASKS")
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or \
            env.get("SLURM_JOB_NODELIST")
        if not nodelist:
            raise ClusterConfigError("SLURM_NODELIST is not set. HINT: start the processes "
                                     "with srun inside an allocation.")
        nodes = expand_nodelist(nodelist)
        local_rank = _int(env, "SLURM_LOCALID", 0)
        node_rank = _int(env, "SLURM_NODEID", 0)
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_STEP_TASKS_PER_NODE") or \
            env.get("SLURM_TASKS_PER_NODE") or ""
        head = re.match(r"^(\d+)", per_node)
        local_world = int(head.group(1)) if head else max(1, world // max(1, len(nodes)))
        if not 0 <= rank < world:
            raise ClusterConfigError(f"SLURM_PROCID={rank} is outside 0..{world - 1} "
                                     f"(SLURM_NTASKS={world})")
        if node_rank >= len(nodes):
            raise ClusterConfigError(f"SLURM_NODEID={node_rank} but the node list {nodelist!r} "
                                     f"has {len(nodes)} node(s)")
        port = self.port or _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
        return ClusterSpec(rank=rank, world_size=world, local_rank=local_rank,
                           local_world_size=max(local_world, local_rank + 1),
                           node_rank=node_rank, master_addr=env.get("MASTER_ADDR", nodes[0]),
                           master_port=port,
                           restart_count=_int(env, RESTART_COUNT_ENV, 0), source="slurm")


def detect(env: Mapping[str, str]) -> ClusterSpec:
    """The spec from the first source present in ``env`` (order: see the module doc)."""
    if "WORLD_SIZE" in env or "RANK" in env:
        return TorchrunResolver().resolve(env)
    if env.get("TF_CONFIG"):
        return TFConfigResolver().resolve(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return SlurmResolver().resolve(env)
    return ClusterSpec(rank=0, world_size=1, source="single-process")


def as_spec(resolver: ClusterResolver | ClusterSpec | None) -> ClusterSpec:
    """The spec a ``cluster_resolver`` argument stands for (``None``: from the environment)."""
    if resolver is None:
        return detect(os.environ)
    if isinstance(resolver, ClusterSpec):
        return resolver
    if not isinstance(resolver, ClusterResolver):
        raise TypeError(f"cluster_resolver must be an rp.cluster.ClusterSpec or a resolver "
                        f"such as rp.cluster.TFConfigResolver(), got {type(resolver).__name__}")
    spec = resolver.resolve()
    if not isinstance(spec, ClusterSpec):
        raise TypeError(f"{type(resolver).__name__}.resolve() returned "
                        f"{type(spec).__name__}, not a ClusterSpec")
    return spec


# -- roll call: do the running processes agree with their specs? ----------------------------

_ROLL = "rollcall"
#: Roll calls made by this process: a group created again in one process (after shutdown,
#: on the same store and attempt) answers a fresh roll call, not the previous one.
_ROUNDS = [0]


def _who(spec: ClusterSpec, rank: int) -> str:
    return f"rank {rank} ({spec.addresses[rank]})" if rank < len(spec.addresses) else f"rank {rank}"


def check_membership(store: Any, spec: ClusterSpec, timeout_seconds: float,
                     poll_seconds: float = 0.05, backend: str | None = None,
                     device_key: str | None = None) -> None:
    """A roll call on the store before the group forms: a spec that disagrees with the running
    processes (size, duplicate rank, missing ranks, backend, a shared GPU) is an error on all."""
    import time

    world, rank = spec.world_size, spec.rank
    if world <= 1:
        return
    _ROUNDS[0] += 1
    roll = f"{_ROLL}/{_ROUNDS[0]}"
    error_key = f"{roll}/error"

    def leave(message: str) -> None:
        if rank == 0:
            # rank 0 usually hosts the store: stay a moment so the others read the verdict
            # (instead of a lost connection) before this process exits
            time.sleep(min(3.0, timeout_seconds))
        raise ClusterConfigError(message)

    def fail(message: str) -> None:
        store.set(error_key, message)
        leave(message)

    def agreed(key: str, value: str) -> str:
        """The value of ``key``: ``value`` if this process set it first."""
        got = store.compare_set(f"{roll}/{key}", "", value)
        return got.decode() if isinstance(got, bytes) else str(got)

    if (first := agreed("world", str(world))) != str(world):
        fail(f"the processes disagree on the size of the job: rank {rank} expects "
             f"{world} processes ({spec.source}), but a process that joined earlier expects "
             f"{first}. HINT: give every process the same cluster description (the same "
             "TF_CONFIG worker list, --nnodes/--nproc-per-node, or ClusterSpec.world_size).")
    if backend is not None and (earlier := agreed("backend", backend)) != backend:
        fail(f"the processes disagree on the backend: {_who(spec, rank)} starts {backend} "
             f"but a process that joined earlier started {earlier}. HINT: every process "
             "must compute on the same kind of device (NCCL for CUDA, gloo for CPU): give "
             "each the same devices= (devices='cpu' on every host, say), or give every "
             "host as many GPUs as it runs processes.")
    if device_key is not None and store.add(f"{roll}/device/{device_key}", 1) > 1:
        fail(f"two processes of the job would compute on the same GPU ({device_key}; seen from "
             f"{_who(spec, rank)}), which NCCL refuses. HINT: start one process per GPU, give "
             "each process its own CUDA_VISIBLE_DEVICES (a CUDA_VISIBLE_DEVICES naming one GPU "
             "for every process of a machine makes each take it), or pass devices='cpu'.")
    if store.add(f"{roll}/rank/{rank}", 1) > 1:
        fail(f"two processes claim {_who(spec, rank)} of {world}: a duplicate task index. "
             "HINT: give every process its own index (TF_CONFIG task.index / RANK / "
             "SLURM_PROCID) from 0 to the number of processes - 1.")
    keys = [f"{roll}/rank/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_seconds
    while True:
        if store.check([error_key]):
            leave(store.get(error_key).decode())
        if store.check(keys):
            break
        if time.monotonic() > deadline:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            names = ", ".join(_who(spec, r) for r in missing)
            fail(f"{len(missing)} of {world} processes did not join within "
                 f"{timeout_seconds:.0f} s: {names} (seen from rank {rank}). HINT: is a host "
                 "missing or unable to reach the chief at "
                 f"{spec.master_addr}:{spec.master_port}? Start every process of the job, or "
                 "list only the processes you start.")
        time.sleep(poll_seconds)
