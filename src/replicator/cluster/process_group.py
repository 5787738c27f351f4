"""Start and stop the ``torch.distributed`` process group, always with a finite timeout; the
store is namespaced per attempt (an old attempt's keys hang a fresh group: pytorch #135712)."""

from __future__ import annotations

import atexit
import functools
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from replicator.cluster.devices import device_identity
from replicator.cluster.environment import ClusterSpec, resolve_cluster
from replicator.cluster.helper_threads import (
    EXIT_WAIT_SECONDS,
    HELPER_THREAD_PREFIX,
    join_helper_threads,
    wait_at_exit,
)
from replicator.cluster.ports import listen
from replicator.cluster.resolvers import check_membership
from replicator.cluster.timeouts import resolve_timeout, set_group_timeout
from replicator.errors import ClusterConfigError


@dataclass
class GroupInfo:
    """What this process knows about the running group."""

    spec: ClusterSpec
    backend: str
    timeout_seconds: float
    store: dist.Store | None
    owned: bool


_GROUP: GroupInfo | None = None


def configure_threads(local_world_size: int) -> int:
    """Give each local worker its share of the cores unless the user chose (OMP_NUM_THREADS):
    two threads per rank on two cores halve gloo's bandwidth."""
    if "OMP_NUM_THREADS" in os.environ:
        threads = max(1, int(os.environ["OMP_NUM_THREADS"] or 1))
    else:
        threads = max(1, (os.cpu_count() or 1) // max(1, local_world_size))
    if local_world_size > 1 or "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(threads)
    return threads


def _make_store(spec: ClusterSpec, timeout: timedelta, backend: str,
                device_key: str | None = None) -> dist.Store:
    if spec.world_size == 1 and spec.master_port is None:
        return dist.HashStore()
    is_master = spec.rank == 0 and not spec.store_is_hosted
    # the chief listens on MASTER_ADDR only (loopback for a local job), never on every interface
    fd = listen(spec.master_addr, spec.master_port or 0).detach() if is_master else None
    try:
        store = dist.TCPStore(spec.master_addr, spec.master_port or 0, spec.world_size, is_master,
                              timeout=timeout, wait_for_workers=False, master_listen_fd=fd)
    except (RuntimeError, OSError) as exc:
        raise ClusterConfigError(
            f"rank {spec.rank} could not reach the rendezvous store at "
            f"{spec.master_addr}:{spec.master_port} within {timeout.total_seconds():.0f} s: "
            f"{exc}. HINT: is rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every "
            "worker?") from exc
    attempt = dist.PrefixStore(f"replicator/attempt_{spec.restart_count}", store)
    check_membership(attempt, spec, timeout.total_seconds(), backend=backend,
                     device_key=device_key)
    return attempt


def initialize(backend: str | None = None, timeout_seconds: float | None = None,
               device: torch.device | None = None) -> GroupInfo:
    """Create the default process group from the environment, once (every rank connected when
    it returns); later calls return it (with the first call's timeout: a later strategy that
    waits another time makes a group of its own). A group the user created is adopted as it is."""
    global _GROUP
    if _GROUP is not None and dist.is_initialized():
        return _GROUP
    spec = resolve_cluster()
    timeout = resolve_timeout(timeout_seconds)
    if dist.is_initialized():
        _GROUP = GroupInfo(spec=spec, backend=dist.get_backend(), timeout_seconds=timeout,
                           store=None, owned=False)
        return _GROUP
    if backend is None:
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
    configure_threads(spec.local_world_size)
    store = _make_store(spec, timedelta(seconds=timeout), backend,
                        device_identity(device) if backend == "nccl" else None)
    kwargs: dict[str, Any] = {}
    if backend == "nccl" and device is not None:
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group(backend, store=store, rank=spec.rank, world_size=spec.world_size,
                            timeout=timedelta(seconds=timeout), **kwargs)
    _GROUP = GroupInfo(spec=spec, backend=backend, timeout_seconds=timeout, store=store,
                       owned=True)
    set_group_timeout(dist.group.WORLD, timeout)
    if backend == "gloo" and spec.world_size > 1:
        # gloo connects one side of a pair before the other: without this, a rank that went
        # on and ended at once closed a peer's half-made connection ("connectFullMesh failed
        # ... Connection closed by peer", beside four CPU hogs)
        dist.barrier()
    wait_at_exit()
    _shutdown_at_exit()
    if spec.source == "single-process":
        _hint_one_replica()
    return _GROUP


@functools.cache
def _hint_one_replica() -> None:
    """Say once per process, on stderr, that a plain ``python script.py`` (no launcher set
    RANK/WORLD_SIZE) is one replica."""
    print("[replicator] running one replica in this process. HINT: to use more, launch with "
          "`replicator run --nproc N script.py` or `torchrun --nproc-per-node N script.py`.",
          file=sys.stderr, flush=True)


def open_store_client(info: GroupInfo, timeout_seconds: float = 10.0) -> dist.Store | None:
    """A second connection to the rendezvous store (same attempt namespace) for a helper
    thread, so it never shares a socket with the process group; ``None`` without a store."""
    spec = info.spec
    if info.store is None or spec.master_port is None or spec.world_size == 1:
        return None
    try:
        client = dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, False,
                               timeout=timedelta(seconds=timeout_seconds))
    except (RuntimeError, OSError):
        return None
    return dist.PrefixStore(f"replicator/attempt_{spec.restart_count}", client)


def current_group() -> GroupInfo | None:
    return _GROUP if dist.is_initialized() else None


_SHUTDOWN_HOOKS: list = []


@functools.cache
def _shutdown_at_exit() -> None:
    """Destroy our group at exit before module teardown (later, gloo's groups abort)."""
    atexit.register(shutdown)


def on_shutdown(hook) -> None:  # noqa: ANN001 - a callable taking nothing
    """Run ``hook()`` before the process group is destroyed (stops helper threads first)."""
    _SHUTDOWN_HOOKS.append(hook)


def shutdown() -> None:
    """Destroy the group this module created (not a user's), after its helpers and a
    background checkpoint save in flight finished."""
    global _GROUP
    while _SHUTDOWN_HOOKS:
        try:
            _SHUTDOWN_HOOKS.pop()()
        except Exception:  # noqa: BLE001 - shutting down must go on
            pass
    if _GROUP is not None and _GROUP.owned and dist.is_initialized():
        join_helper_threads(EXIT_WAIT_SECONDS, HELPER_THREAD_PREFIX + "checkpoint")
        dist.destroy_process_group()
    _GROUP = None


