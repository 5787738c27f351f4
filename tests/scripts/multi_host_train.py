"""Training script of the multi-host tests: 20 steps of a small MLP, the same on any launch.

Usage: multi_host_train.py OUT_DIR [--strategy one_device|multi_worker] [--algorithm NAME]
       [--steps N] [--resolver env|tf_config|slurm] [--batch B]
The chief writes OUT_DIR/final.safetensors; every rank writes OUT_DIR/rank<R>.json with its
host key, the algorithm chosen, for the hierarchical one the hosts and leaders it built, and the
bytes it sent to other hosts during the training steps.
"""

import argparse
import json
import os
import socket
import struct
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

import replicator as rp
from replicator.cluster.hosts import local_host_key

ALGORITHMS = {"native": rp.comm.NativeAllReduce, "ring": rp.comm.RingAllReduce,
              "hierarchical": rp.comm.HierarchicalAllReduce}


def inter_host_bytes_sent(seen: list[str] | None = None) -> dict[str, int]:
    """Bytes this process has sent (and had acknowledged) over each of its open TCP connections
    to other hosts (sockets whose peer address differs from their local address; TCP_INFO),
    keyed by the socket's inode, so that a count over a window can skip connections that
    closed or opened in it. ``seen`` gets a line per socket looked at (family, addresses,
    bytes), for a report."""
    sent: dict[str, int] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            if s.family != socket.AF_INET or s.type != socket.SOCK_STREAM:
                continue
            local, peer = s.getsockname()[0], s.getpeername()[0]
            if local != peer:
                info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232)
                sent[link] = struct.unpack_from("Q", info, 120)[0]  # tcpi_bytes_acked
            if seen is not None:
                seen.append(f"{link} {local}->{peer} {sent.get(link, '-')}")
        except OSError as exc:
            if seen is not None and link.startswith("socket:"):
                seen.append(f"{link} {type(exc).__name__}")
        finally:
            s.close()
    return sent


def sent_since(start: dict[str, int], seen: list[str] | None = None) -> int:
    """Bytes sent to other hosts since ``start`` on the connections open at both counts (a
    connection that closed in between would make a plain difference of sums negative)."""
    now = inter_host_bytes_sent(seen)
    return sum(n - start.get(key, 0) for key, n in now.items())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--strategy", default="multi_worker")
    p.add_argument("--algorithm", default="auto")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--resolver", default="env")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--batch", type=int, default=32, help="the global batch")
    args = p.parse_args()
    out = Path(args.out)
    if args.strategy == "one_device":
        strategy = rp.OneDeviceStrategy("cpu")
    else:
        algo = None if args.algorithm == "auto" else ALGORITHMS[args.algorithm]()
        resolver = {"tf_config": rp.cluster.TFConfigResolver(),
                    "slurm": rp.cluster.SlurmResolver()}.get(args.resolver)
        strategy = rp.MultiWorkerMirroredStrategy(resolver, cross_device_ops=algo)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2 * args.batch * args.steps, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch, shuffle=True,
                        generator=torch.Generator().manual_seed(5))
    with strategy.scope():
        torch.manual_seed(1)
        model = torch.nn.Sequential(torch.nn.Linear(10, args.width), torch.nn.ReLU(),
                                    torch.nn.Linear(args.width, 2))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(batch):
        xb, yb = batch
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss.detach()

    data = iter(strategy.distribute_dataset(loader))
    if args.strategy != "one_device":
        strategy.barrier()
    sockets_at_start: list[str] = []  # what each count saw, for a failing test's report
    sent_at_start = inter_host_bytes_sent(sockets_at_start)  # after the setup (one broadcast)
    for _ in range(args.steps):
        strategy.run(step, args=(next(data),))
    rank = strategy.replica_id
    info = {"rank": rank, "world": strategy.num_replicas_in_sync, "host": local_host_key()}
    if args.strategy != "one_device":
        ops = strategy.cross_device_ops
        info["algorithm"] = type(ops).__name__
        if isinstance(ops, rp.comm.HierarchicalAllReduce):
            topo = ops.topology_for(strategy.group)
            info["hosts"] = [list(h) for h in topo.hosts]
            info["leaders"] = list(topo.leaders)
            info["shared_memory"] = bool(topo.shared_memory)
        strategy.barrier()
        sockets_at_end: list[str] = []
        info["inter_host_sent"] = sent_since(sent_at_start, sockets_at_end)
        info["sockets"] = {"start": sockets_at_start, "end": sockets_at_end}
    (out / f"rank{rank}.json").write_text(json.dumps(info))
    if strategy.is_chief:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()},
                  str(out / "final.safetensors"))
    print(f"rank {rank} of {strategy.num_replicas_in_sync} on {info['host']} done", flush=True)


if __name__ == "__main__":
    main()
    # Leave as `replicator run` leaves a finished script: output flushed, no C++ static
    # destructors. Run directly (torchrun, TF_CONFIG, SLURM), a finished gloo job can still
    # abort at interpreter teardown ("terminate called without an active exception"), which
    # these equivalence tests are not about.
    import sys as _sys

    _sys.stdout.flush()
    _sys.stderr.flush()
    os._exit(0)
