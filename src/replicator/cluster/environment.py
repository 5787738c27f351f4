"""Who am I: resolve rank, world and rendezvous address from the launcher's environment.

Three sources are understood, in this order: replicator's local launcher and ``torchrun``
(both export ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), a ``TF_CONFIG`` JSON
cluster description, and nothing at all (a plain ``python script.py``: one replica).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

from replicator.errors import ClusterConfigError

#: Environment variables the local launcher sets in addition to torchrun's names.
LAUNCHER_ENV = "REPLICATOR_LAUNCHER"
STORE_HOSTED_ENV = "REPLICATOR_STORE_HOSTED"
RESTART_COUNT_ENV = "REPLICATOR_RESTART_COUNT"
TIMEOUT_ENV = "REPLICATOR_TIMEOUT_SECONDS"


@dataclass(frozen=True)
class ClusterSpec:
    """The position of this process in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int | None
    restart_count: int
    store_is_hosted: bool
    source: str
    role: str = "worker"

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // max(1, self.local_world_size))


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


def _from_torchrun_style(env: Mapping[str, str]) -> ClusterSpec:
    world = _int(env, "WORLD_SIZE")
    rank = _int(env, "RANK")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    local_rank = _int(env, "LOCAL_RANK", rank % max(local_world, 1))
    if world < 1:
        raise ClusterConfigError(f"WORLD_SIZE={world}: the world needs at least one replica")
    if not 0 <= rank < world:
        raise ClusterConfigError(f"RANK={rank} is outside 0..{world - 1} (WORLD_SIZE={world})")
    if not 0 <= local_rank < local_world:
        raise ClusterConfigError(f"LOCAL_RANK={local_rank} is outside 0..{local_world - 1}")
    launcher = env.get(LAUNCHER_ENV)
    torchrun = "TORCHELASTIC_RUN_ID" in env
    restart = _int(env, RESTART_COUNT_ENV, _int(env, "TORCHELASTIC_RESTART_COUNT", 0))
    hosted = env.get(STORE_HOSTED_ENV) == "1" or env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    port = _int(env, "MASTER_PORT", 0) or None
    if world > 1 and port is None:
        raise ClusterConfigError("MASTER_PORT is not set but WORLD_SIZE > 1")
    return ClusterSpec(
        rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", rank // max(local_world, 1)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=port,
        restart_count=restart, store_is_hosted=hosted,
        source="local-launcher" if launcher else ("torchrun" if torchrun else "environment"),
    )


def _from_tf_config(raw: str) -> ClusterSpec:
    try:
        config = json.loads(raw)
        workers = list(config["cluster"].get("chief", [])) + list(config["cluster"]["worker"])
        task = config["task"]
        role, index = task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ClusterConfigError(
            f"TF_CONFIG is not a valid cluster description ({exc!r}); expected "
            '{"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}'
        ) from None
    n_chief = len(config["cluster"].get("chief", []))
    rank = index if role == "chief" else n_chief + index
    if role not in ("chief", "worker") or not 0 <= rank < len(workers):
        raise ClusterConfigError(f"TF_CONFIG task {task} is not among the cluster's workers")
    host, _, port = workers[0].rpartition(":")
    if not port.isdigit():
        raise ClusterConfigError(f"TF_CONFIG address {workers[0]!r} has no port")
    return ClusterSpec(rank=rank, world_size=len(workers), local_rank=0, local_world_size=1,
                       node_rank=rank, master_addr=host, master_port=int(port), restart_count=0,
                       store_is_hosted=False, source="tf_config", role=role)


def resolve_cluster(env: Mapping[str, str] | None = None) -> ClusterSpec:
    """Read this process's place in the job from the environment (see module doc)."""
    env = os.environ if env is None else env
    if "WORLD_SIZE" in env or "RANK" in env:
        return _from_torchrun_style(env)
    if env.get("TF_CONFIG"):
        return _from_tf_config(env["TF_CONFIG"])
    return ClusterSpec(rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                       master_addr="127.0.0.1", master_port=None, restart_count=0,
                       store_is_hosted=False, source="single-process")


def timeout_from_env(default: float, env: Mapping[str, str] | None = None) -> float:
    """The collective timeout in seconds set by the launcher, else ``default``."""
    env = os.environ if env is None else env
    raw = env.get(TIMEOUT_ENV)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ClusterConfigError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ClusterConfigError(f"{TIMEOUT_ENV} must be positive, got {value}")
    return value
