"""Across hosts: hierarchical vs flat ring vs native all-reduce over a token-bucket link.

Two network hosts (network namespaces on a bridge, from tests/hosts.py) run 2 processes each,
launched with ``replicator run --nnodes 2``. Each host's link to the bridge is limited with
``tc qdisc tbf`` in both directions (1 Gbit/s, then 100 Mbit/s); loopback inside a host is
unlimited. In one job per rate, interleaved round by round: the all-reduce time of a 25 MB
float32 tensor and the training-step time of a 25 MB model (Linear(2560, 2560) + head, batch
32 per replica) with each algorithm. Reported as JSON lines ``{"bench": "multi_node", "name":
"hier_vs_ring_1gbit", "ratio": ring / hierarchical, "goal": ">= 1.3"}`` (also ``hier_vs_native``
and ``step_hier_vs_*``), and ``link_utilisation_<rate>``: the bytes the hierarchical leader
sent to the other host per second of all-reduce (TCP_INFO of its own sockets) over the link's
configured rate (goal >= 0.8).

With a bottleneck per host a flat ring moves 1.5x the bytes the leaders do, so 1.5 is the
ceiling of ``hier_vs_ring``. Needs root (network namespaces). Run:
``python benchmarks/multi_node.py [--rates 1gbit 100mbit] [--rounds 5] [--step-rounds 5]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._report import emit, median, print_table  # noqa: E402

MB = 1024 * 1024
ALGOS = ("hierarchical", "ring", "native")
RATE_BITS = {"1gbit": 1e9, "100mbit": 1e8}


def inter_host_bytes_sent() -> int:
    """Bytes this process sent (acknowledged) on its TCP connections to other hosts."""
    total = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if s.family == socket.AF_INET and s.type == socket.SOCK_STREAM and \
                    s.getsockname()[0] != s.getpeername()[0]:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
                total += struct.unpack_from("Q", info, 120)[0]  # tcpi_bytes_acked
        except OSError:
            pass
        finally:
            s.close()
    return total


# -- inside each worker process -------------------------------------------------------------
def _worker(out: Path, rounds: int, step_rounds: int) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import replicator as rp

    algos = {"hierarchical": rp.comm.HierarchicalAllReduce, "ring": rp.comm.RingAllReduce,
             "native": rp.comm.NativeAllReduce}
    strategies = {name: rp.MultiWorkerMirroredStrategy(cross_device_ops=cls())
                  for name, cls in algos.items()}
    rank = dist.get_rank()
    x = torch.randn(25 * MB // 4)
    ops = {name: s.cross_device_ops for name, s in strategies.items()}
    for op in ops.values():  # warm-up: groups, connections, buffers
        op.all_reduce_sum(x)
    times: dict[str, list[float]] = {a: [] for a in ALGOS}
    leader_bytes, leader_seconds = 0, 0.0
    for _ in range(rounds):
        for name, op in ops.items():
            x.normal_()
            dist.barrier()
            sent = inter_host_bytes_sent()
            t = time.perf_counter()
            op.all_reduce_sum(x)
            elapsed = time.perf_counter() - t
            times[name].append(elapsed)
            if name == "hierarchical" and rank == 0:
                leader_bytes += inter_host_bytes_sent() - sent
                leader_seconds += elapsed
    models, steps = {}, {}
    for name, strategy in strategies.items():
        with strategy.scope():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(2560, 2560), torch.nn.ReLU(),
                                        torch.nn.Linear(2560, 10))
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
        models[name] = (strategy, model, opt)

    def make_step(model, opt):
        def step(xb, yb):
            loss = F.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return step

    xb, yb = torch.randn(32, 2560), torch.randint(0, 10, (32,))
    step_times: dict[str, list[float]] = {a: [] for a in ALGOS}
    for name, (strategy, model, opt) in models.items():
        steps[name] = make_step(model, opt)
        strategy.run(steps[name], args=(xb, yb))  # warm-up
    for _ in range(step_rounds):
        for name, (strategy, _, _) in models.items():
            dist.barrier()
            t = time.perf_counter()
            strategy.run(steps[name], args=(xb, yb))
            step_times[name].append(time.perf_counter() - t)
    result = {}
    for label, table in (("allreduce", times), ("step", step_times)):
        for name, mine in table.items():
            slowest = torch.tensor(mine, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            result[f"{label}_{name}"] = slowest.tolist()
    if rank == 0:
        result["leader_bytes"] = leader_bytes
        result["leader_seconds"] = leader_seconds
        out.write_text(json.dumps(result))


# -- the driver ----------------------------------------------------------------------------
def _run_rate(rate: str, rounds: int, step_rounds: int, port: int) -> dict:
    from tests.hosts import virtual_hosts

    with virtual_hosts(2) as net, tempfile.TemporaryDirectory() as tmp:
        burst = f"{max(256, int(RATE_BITS[rate] / 8 / 1024 / 100))}kb"  # >= 10 ms of tokens
        net.limit_rate(rate, burst=burst)
        out = Path(tmp) / "result.json"
        env = {"TMPDIR": tmp, "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])}
        procs = [h.popen([sys.executable, "-m", "replicator.cli", "run", "--nnodes", "2",
                          "--node-rank", str(h.index), "--master-addr", net.hosts[0].address,
                          "--master-port", str(port), "--nproc-per-node", "2", "--timeout",
                          "300", "--quiet-workers", __file__, "--worker", str(out),
                          "--rounds", str(rounds), "--step-rounds", str(step_rounds)], env=env)
                 for h in net.hosts]
        for proc in procs:
            if proc.wait(timeout=1800) != 0:
                raise SystemExit(f"the {rate} run failed (exit code {proc.returncode})")
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=list(RATE_BITS), choices=list(RATE_BITS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-rounds", type=int, default=5)
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.rounds, args.step_rounds)
        return
    from tests.hosts import namespaces_unavailable

    why = namespaces_unavailable()
    if why:
        raise SystemExit(f"benchmarks/multi_node.py needs network namespaces: {why}")
    rows, lines = [], []
    for i, rate in enumerate(args.rates):
        res = _run_rate(rate, args.rounds, args.step_rounds, 29400 + i)
        med = {k: median(v) for k, v in res.items() if isinstance(v, list)}
        util = res["leader_bytes"] / max(res["leader_seconds"], 1e-9) / (RATE_BITS[rate] / 8)
        for name in ALGOS:
            rows.append([rate, name, med[f"allreduce_{name}"] * 1e3, med[f"step_{name}"] * 1e3])
        for other in ("ring", "native"):
            lines.append(("multi_node", f"hier_vs_{other}_{rate}",
                          med[f"allreduce_{other}"] / med["allreduce_hierarchical"], ">= 1.3",
                          {"hierarchical_ms": round(med["allreduce_hierarchical"] * 1e3, 1),
                           f"{other}_ms": round(med[f"allreduce_{other}"] * 1e3, 1)}))
            lines.append(("multi_node", f"step_hier_vs_{other}_{rate}",
                          med[f"step_{other}"] / med["step_hierarchical"], ">= 1.3",
                          {"hierarchical_ms": round(med["step_hierarchical"] * 1e3, 1),
                           f"{other}_ms": round(med[f"step_{other}"] * 1e3, 1)}))
        lines.append(("multi_node", f"link_utilisation_{rate}", util, ">= 0.8",
                      {"leader_bytes": res["leader_bytes"],
                       "leader_seconds": round(res["leader_seconds"], 3)}))
    print_table(["link", "algorithm", "all-reduce 25 MB (ms)", "step 25 MB model (ms)"], rows)
    for bench, name, ratio, goal, extra in lines:
        emit(bench, name, ratio, goal, **extra)


if __name__ == "__main__":
    main()
