"""Multi-node launch on ``torch.distributed.elastic``: ``replicator run --nnodes N ...``.

torchrun's static rendezvous run by torch's elastic agent (its supervision and restarts), except
that node 0's store listens on ``--master-addr`` only and gloo gets the interface that routes to
the master. No authentication: run it on trusted networks.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from replicator.cluster.env_names import LAUNCHER_ENV, RUN_ID_ENV, TIMEOUT_ENV
from replicator.cluster.ports import DEFAULT_MASTER_PORT, check_port, choose_gloo_interface, listen
from replicator.cluster.timeouts import DEFAULT_TIMEOUT_SECONDS
from replicator.errors import ClusterConfigError, WorkerFailedError
from replicator.launch.launcher import check_count, check_num_replicas, check_script

#: The rendezvous backend registered with torch's rendezvous registry by this module.
RENDEZVOUS_BACKEND = "replicator-static"

def _register_rendezvous() -> None:
    """Register the static rendezvous whose store listens on the master address only."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import RendezvousParameters, registry
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import (
        StaticTCPRendezvous,
        create_rdzv_handler,
    )

    class BoundStaticRendezvous(StaticTCPRendezvous):
        """torch's static rendezvous, with node 0's store bound to the master address."""

        def get_backend(self) -> str:
            return RENDEZVOUS_BACKEND

        def next_rendezvous(self) -> Any:
            if not self._store:
                is_master = self.rank == 0
                fd = listen(self.master_addr, self.master_port).detach() if is_master else None
                try:
                    self._store = TCPStore(self.master_addr, self.master_port, self.world_size,
                                           is_master, self.timeout, multi_tenant=True,
                                           master_listen_fd=fd)
                except (RuntimeError, OSError) as exc:
                    waited = f"{self.timeout.total_seconds():.0f} s"
                    if is_master:
                        raise ClusterConfigError(
                            f"node 0 waited {waited} at {self.master_addr}:{self.master_port} "
                            f"for the other {self.world_size - 1} node(s) of --nnodes "
                            f"{self.world_size} ({exc}). HINT: is a node missing, unable to "
                            "reach this address, or started with another --nnodes? Start "
                            "every node within --rdzv-timeout.") from None
                    raise ClusterConfigError(
                        f"node {self.rank} could not reach the rendezvous store of node 0 at "
                        f"{self.master_addr}:{self.master_port} within {waited} ({exc}). "
                        "HINT: start node 0 first or within --rdzv-timeout, and give every "
                        "node the same --master-addr/--master-port (node 0's address on this "
                        "network).") from None
            return super().next_rendezvous()

    def create(params: RendezvousParameters) -> StaticTCPRendezvous:
        base = create_rdzv_handler(params)
        assert isinstance(base, StaticTCPRendezvous)  # torch's own factory's type
        return BoundStaticRendezvous(base.master_addr, base.master_port, base.rank,
                                     base.world_size, base.run_id,
                                     int(base.timeout.total_seconds()))

    try:
        registry.handler_registry.register(RENDEZVOUS_BACKEND, create)
    except ValueError:
        pass  # registered already in this process


def check_multi_node_args(nnodes: int, node_rank: int | None, master_addr: str | None) -> None:
    """Clear errors for an inconsistent multi-node command line."""
    check_num_replicas(nnodes, "--nnodes")
    if node_rank is None:
        raise ClusterConfigError("--nnodes > 1 needs --node-rank (0 on the master node, 1.. on "
                                 "the others). HINT: run the same command on every node with "
                                 "its own --node-rank.")
    if not 0 <= node_rank < nnodes:
        raise ClusterConfigError(f"--node-rank {node_rank} is outside 0..{nnodes - 1} "
                                 f"(--nnodes {nnodes}). HINT: number the nodes 0 to {nnodes - 1}.")
    if not master_addr:
        raise ClusterConfigError("--nnodes > 1 needs --master-addr: the address of node 0 that "
                                 "every node can reach. HINT: e.g. --master-addr 10.0.0.1")


def run_multi_node(script: str, script_args: list[str] | tuple[str, ...] = (), *,
                   nnodes: int, node_rank: int | None, master_addr: str | None,
                   nproc_per_node: int, master_port: int | None = None,
                   max_restarts: int = 0, timeout_seconds: float | None = None,
                   rdzv_timeout: float = DEFAULT_TIMEOUT_SECONDS,
                   run_id: str | None = None) -> None:
    """Run this node's ``nproc_per_node`` workers of an ``nnodes``-node job (see module doc)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    check_multi_node_args(nnodes, node_rank, master_addr)
    node_rank, master_addr = int(node_rank or 0), str(master_addr)  # checked just above
    nproc_per_node = check_num_replicas(nproc_per_node, "--nproc-per-node")
    port = check_port(master_port) or DEFAULT_MASTER_PORT
    check_script(script)
    check_count(max_restarts, "--max-restarts", hint="0 turns restarts off.")
    choose_gloo_interface(master_addr)
    os.environ[LAUNCHER_ENV] = "multi-node"
    if timeout_seconds is not None:
        os.environ[TIMEOUT_ENV] = str(timeout_seconds)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    _register_rendezvous()
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node,
        run_id=run_id or os.environ.get(RUN_ID_ENV, "") or f"replicator-{port}",
        rdzv_endpoint=f"{master_addr}:{port}", rdzv_backend=RENDEZVOUS_BACKEND,
        rdzv_configs={"rank": node_rank, "timeout": int(rdzv_timeout)},
        max_restarts=max_restarts, monitor_interval=0.1, start_method="spawn",
        local_addr=master_addr if node_rank == 0 else None, shutdown_timeout=10)
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "replicator.launch.script_entry",
                                               str(script), *script_args)
    except ClusterConfigError:
        raise
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        raise WorkerFailedError(rank, failure.exitcode,
                                f"{failure.message or 'worker failed'} on node {node_rank} "
                                f"after {max_restarts} restart(s) allowed") from None
    except (RendezvousError, TimeoutError, RuntimeError) as exc:
        text = str(exc).lower()
        if isinstance(exc, RuntimeError) and "timeout" not in text and "timed out" not in text:
            raise
        raise ClusterConfigError(
            f"node {node_rank}: the rendezvous of {nnodes} nodes at {master_addr}:{port} did "
            f"not complete within {rdzv_timeout:.0f} s ({exc}). HINT: start every node with "
            "the same --nnodes and --master-addr/--master-port; is a node missing?") from None


__all__ = ["run_multi_node", "check_multi_node_args", "RENDEZVOUS_BACKEND"]
