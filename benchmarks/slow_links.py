"""Training across slow links: DiLoCo against per-step synchronous training.

The task: a small character-level transformer (2 layers, width 64, context 64, about 140k
parameters) trained on the source of Python's standard library (the top-level ``*.py``
files); the held-out loss is measured on files it never saw (one file in ten, by name).
Every variant sees the same samples in the same order (one epoch over a fixed list of
windows), global batch 64, inner optimizer AdamW (lr 1e-3).

Two parts:

- ``throughput``: 2 hosts x 2 processes in network namespaces (``tests/hosts.py``; always
  removed afterwards), each host's link limited with ``tc tbf`` to 10 and 100 Mbit/s;
  ``replicator run --nnodes 2`` of this file's worker. Per-step ``MultiWorkerMirroredStrategy``
  against ``DiLoCoStrategy(inner_steps=50)`` and its int8 streaming form (2 fragments, a delay
  of 5 steps): samples/s over steps 11..110 (two outer rounds) and the bytes through each
  host's interface in that window (read from its counters by the host's first process).
  Medians of ``--repeats`` runs, with their ranges. The peer, ``torchft_diloco`` (with
  ``--peer``): torchft's own ``DiLoCo`` on the same hosts, model, samples, H and outer
  optimizer, each host one replica group (``torchrun --standalone`` of 2 processes joined by
  DDP every step) under a ``Manager`` and a lighthouse on host 0; torchft sends the
  pseudo-gradient from every process (rank k of each group with rank k of the others), where
  ours sends one copy per host. ``vs_torchft_diloco``: ours (DiLoCo H=50) / torchft's. Beside
  samples/s, the table splits each run's timed steps (first process of host 0): the mean of
  the steps that end an outer round (where DiLoCo crosses the link) and the median of the
  others (compute and each host's own collectives, which the load of the cores decides), and
  ``round_end_step_vs_torchft`` compares the former.
- ``loss``: the held-out loss at equal samples after 8 and after ``--rounds`` outer rounds of
  50 steps, on one machine (the link does not change the loss): 4 processes, per-step
  ``MirroredStrategy`` against DiLoCo on 2 declared hosts, uncompressed and int4. The runs are
  deterministic (same seeds, same samples), so one run per variant.

Run (root, for the namespaces): ``python benchmarks/slow_links.py [--part throughput loss]
[--rates 10mbit 100mbit] [--repeats 3] [--rounds 40]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import replicator as rp  # noqa: E402
from benchmarks._report import emit, print_table  # noqa: E402

CONTEXT, WIDTH, GLOBAL_BATCH, H = 64, 64, 64, 50
VARIANTS = ("sync", "diloco", "diloco_int8_streaming", "diloco_int4")
PEER = "torchft_diloco"
#: A run of 110 steps takes 1-3 minutes here; one that runs past this is stuck.
RUN_TIMEOUT_S = 600
LIGHTHOUSE_PORT = 29510


# -- the task -----------------------------------------------------------------------------------
def _corpus(held_out: bool, limit: int = 3_000_000) -> torch.Tensor:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    chosen = [f for f in files if (zlib.crc32(f.name.encode()) % 10 == 0) == held_out]
    data = b"".join(f.read_bytes() for f in chosen)[:limit]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Windows(torch.utils.data.Dataset):
    """``count`` windows of ``CONTEXT + 1`` bytes at seeded positions of ``text``."""

    def __init__(self, text: torch.Tensor, count: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.text = text
        self.starts = torch.randint(0, len(text) - CONTEXT - 1, (count,), generator=g)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = int(self.starts[i])
        chunk = self.text[s:s + CONTEXT + 1]
        return chunk[:-1], chunk[1:]


class CharTransformer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(256, WIDTH)
        self.position = torch.nn.Parameter(torch.randn(CONTEXT, WIDTH) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0,
                                                 batch_first=True, norm_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.head = torch.nn.Linear(WIDTH, 256)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(
            CONTEXT), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position[:x.shape[1]]
        h = self.blocks(h, mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def _held_out_loss(model: torch.nn.Module, batches: int = 16) -> float:
    data = Windows(_corpus(held_out=True), batches * 64, seed=99)
    losses = []
    with torch.no_grad():
        for b in range(batches):
            x, y = zip(*(data[i] for i in range(b * 64, (b + 1) * 64)))
            logits = model(torch.stack(x))
            losses.append(float(F.cross_entropy(logits.reshape(-1, 256), torch.stack(y)
                                                .reshape(-1))))
    return sum(losses) / len(losses)


def _strategy(variant: str, hosts: int | None) -> rp.Strategy:
    if variant == "sync":
        return rp.MultiWorkerMirroredStrategy() if hosts is None else rp.MirroredStrategy()
    options: dict[str, Any] = {"inner_steps": H, "hosts": hosts}
    if variant == "diloco_int8_streaming":
        options.update(fragments=2, sync_delay=5, compression="int8")
    elif variant == "diloco_int4":
        options.update(compression="int4")
    return rp.DiLoCoStrategy(**options)


def _host_bytes() -> int:
    base = Path("/sys/class/net") / os.environ.get("GLOO_SOCKET_IFNAME", "eth0") / "statistics"
    return sum(int((base / f"{d}_bytes").read_text()) for d in ("tx", "rx"))


def _step_split(times: list[float], warm: int) -> dict[str, float]:
    """Seconds of the timed steps (after ``warm``) that end an outer round (where DiLoCo
    crosses the link; their mean), and the median of the others (compute and the hosts'
    own collectives): what the link decides and what the cores decide, apart."""
    ends = [t for step, t in enumerate(times, start=1) if step > warm and step % H == 0]
    inner = [t for step, t in enumerate(times, start=1) if step > warm and step % H]
    return {"round_end_s": statistics.mean(ends) if ends else 0.0,
            "inner_step_s": statistics.median(inner) if inner else 0.0}


def train(variant: str, steps: int, out: str, hosts: int | None = None, warm: int = 10,
          evaluate_at: tuple[int, ...] = ()) -> None:
    """One run (a worker of the job): train ``steps`` steps, write figures to ``out``."""
    torch.set_num_threads(1)
    strategy = _strategy(variant, hosts)
    with strategy.scope():
        torch.manual_seed(0)
        model = CharTransformer()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data = strategy.distribute_dataset(Windows(_corpus(False), steps * GLOBAL_BATCH, seed=1),
                                       batch_size=GLOBAL_BATCH, shuffle=False)
    local_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    record: dict[str, Any] = {"variant": variant, "losses": {}}

    def step_fn(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()

    started = link = 0.0
    times = []
    for step, batch in enumerate(data, start=1):
        begun = time.perf_counter()
        strategy.run(step_fn, args=(batch,))
        times.append(time.perf_counter() - begun)
        if step == warm:
            started, link = time.perf_counter(), _host_bytes() if hosts is None else 0
        if step in evaluate_at and strategy.is_chief:
            record["losses"][step] = _held_out_loss(model)
    record["samples_per_s"] = (steps - warm) * GLOBAL_BATCH / (time.perf_counter() - started)
    record.update(_step_split(times, warm))
    if hosts is None and local_first:
        record["link_bytes_per_step"] = (_host_bytes() - link) / (steps - warm)
    rank = int(os.environ.get("RANK", "0"))
    if local_first:
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    strategy.close()


def train_torchft(steps: int, out: str, warm: int = 10) -> None:
    """The peer (a worker of one host's ``torchrun``): torchft's DiLoCo over the groups."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group, groups = int(os.environ["REPLICA_GROUP_ID"]), int(os.environ["NUM_REPLICA_GROUPS"])
    local, per_host = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = CharTransformer()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    ddp = DistributedDataParallel(model)
    wait = timedelta(seconds=300)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=wait), min_replica_size=groups, use_async_quorum=False,
        load_state_dict=lambda state: model.load_state_dict(state["model"]),
        state_dict=lambda: {"model": model.state_dict()}, replica_id=f"host{group}",
        hostname=os.environ["HOST_ADDRESS"], store_addr=os.environ["HOST_ADDRESS"],
        store_port=int(os.environ["MASTER_PORT"]), timeout=wait, quorum_timeout=wait,
        init_sync=False)  # every group starts from the same seed (no heal at step 0)
    data = Windows(_corpus(False), steps * GLOBAL_BATCH, seed=1)
    share = GLOBAL_BATCH // (groups * per_host)
    first = (group * per_host + local) * share  # the same rows as ours: rank-major shares
    started = link = 0.0
    with DiLoCo(manager, [model], inner, outer, sync_every=H, pin_memory=False):
        times = []
        for step in range(1, steps + 1):
            begun = time.perf_counter()
            rows = [data[(step - 1) * GLOBAL_BATCH + first + i] for i in range(share)]
            x, y = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
            F.cross_entropy(ddp(x).reshape(-1, 256), y.reshape(-1)).backward()
            inner.step()
            inner.zero_grad()
            times.append(time.perf_counter() - begun)
            if step == warm:
                started, link = time.perf_counter(), _host_bytes()
    record = {"variant": PEER, "losses": {},
              "samples_per_s": (steps - warm) * GLOBAL_BATCH / (time.perf_counter() - started),
              **_step_split(times, warm)}
    if local == 0:
        record["link_bytes_per_step"] = (_host_bytes() - link) / (steps - warm)
        Path(out, f"rank{group * per_host}.json").write_text(json.dumps(record))
    manager.shutdown(wait=False)
    dist.destroy_process_group()


# -- the parent ---------------------------------------------------------------------------------
def _commands(variant: str, net: Any, port: int, steps: int, tmp: str) -> list[list[str]]:
    """Each host's command line: ``replicator run`` of ours over both hosts, or the peer's
    ``torchrun`` of this host's group."""
    tail = [__file__, "--worker", variant, "--steps", str(steps), "--out", tmp]
    if variant == PEER:
        # the host's own world on its loopback (its hostname resolves nowhere)
        return [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
                 "--rdzv-backend", "static", "--master-addr", "127.0.0.1", "--master-port",
                 str(port), "--nproc-per-node", "2", *tail] for _ in net.hosts]
    return [[sys.executable, "-m", "replicator.cli", "run", "--nnodes", "2", "--node-rank",
             str(h.index), "--master-addr", net.hosts[0].address, "--master-port", str(port),
             "--nproc-per-node", "2", "--timeout", "600", "--quiet-workers", *tail]
            for h in net.hosts]


def _start_lighthouse(net: Any) -> None:
    from replicator.launch.lighthouse import lighthouse_command

    net.hosts[0].popen(lighthouse_command() + [
        "--min_replicas", "2", "--bind", f"{net.hosts[0].address}:{LIGHTHOUSE_PORT}",
        "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://{net.hosts[0].address}:{LIGHTHOUSE_PORT}"  # answers only inside the hosts
    net.hosts[0].run([sys.executable, "-c", "import sys; from replicator.launch.lighthouse "
                      "import wait_reachable; wait_reachable(sys.argv[1], 30)", url],
                     timeout=60)


def _throughput_run(variant: str, rate: str, steps: int, port: int) -> dict[str, float]:
    from tests.hosts import virtual_hosts

    with virtual_hosts(2) as net, tempfile.TemporaryDirectory() as tmp:
        bits = float(rate.lower().removesuffix("mbit")) * 1e6
        net.limit_rate(rate, burst=f"{max(256, int(bits / 8 / 1024 / 100))}kb")
        env = {"TMPDIR": tmp, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        if variant == PEER:
            _start_lighthouse(net)
        peer = {"TORCHFT_LIGHTHOUSE": f"http://{net.hosts[0].address}:{LIGHTHOUSE_PORT}",
                "NUM_REPLICA_GROUPS": str(len(net.hosts))}
        procs = [h.popen(argv, env={**env, **(peer if variant == PEER else {}),
                                    "REPLICA_GROUP_ID": str(h.index), "HOST_ADDRESS": h.address},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for h, argv in zip(net.hosts, _commands(variant, net, port, steps, tmp))]
        try:
            logs = [p.communicate(timeout=RUN_TIMEOUT_S)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for h in net.hosts:
                h.kill_all()
            logs = [p.communicate(timeout=30)[0] for p in procs]
            raise SystemExit(f"{variant} at {rate} ran past {RUN_TIMEOUT_S} s:\n"
                             + "\n".join(logs)[-3000:]) from None
        if any(p.returncode for p in procs):
            raise SystemExit(f"{variant} at {rate} failed:\n" + "\n".join(logs)[-3000:])
        records = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    return {"samples_per_s": records[0]["samples_per_s"],
            "round_end_s": records[0]["round_end_s"],
            "inner_step_s": records[0]["inner_step_s"],
            "link_bytes_per_step": sum(r["link_bytes_per_step"] for r in records)}


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} [{min(values):.4g}, {max(values):.4g}]"


def throughput(rates: list[str], repeats: int, record: Path | None,
               variants: tuple[str, ...] = ("sync", "diloco", "diloco_int8_streaming")) -> None:
    """``record``: a JSON-lines file of finished runs, kept and reused (a rerun goes on)."""
    done = [json.loads(line) for line in record.read_text().splitlines()] \
        if record is not None and record.exists() else []
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    port = 29700
    for repeat in range(repeats):  # interleaved: a busy spell of the machine hits every variant
        for rate in rates:
            for variant in variants:
                port += 1
                key = {"variant": variant, "rate": rate, "repeat": repeat}
                found = [d for d in done if all(d[k] == v for k, v in key.items())]
                result = found[0] if found else _throughput_run(variant, rate, 110, port)
                if not found and record is not None:
                    with record.open("a") as f:
                        f.write(json.dumps({**key, **result}) + "\n")
                runs.setdefault((variant, rate), []).append(result)
    rows = []  # runs recorded before the step split carry no round_end_s: .get below
    for (variant, rate), results in runs.items():
        rows.append([variant, rate, _summary([r["samples_per_s"] for r in results]),
                     _summary([r["link_bytes_per_step"] / 1e3 for r in results]),
                     _summary([r.get("round_end_s", 0.0) for r in results]),
                     _summary([r.get("inner_step_s", 0.0) for r in results])])
    print_table(["variant", "link", "samples/s median [range]", "link kB/step (both hosts)",
                 "round-end step s", "other steps s (median)"], rows)
    for rate in rates:
        if PEER in variants and "diloco" in variants:
            ratios = [d["samples_per_s"] / t["samples_per_s"]
                      for d, t in zip(runs[("diloco", rate)], runs[(PEER, rate)])]
            ends = [d.get("round_end_s", 0.0) / max(t.get("round_end_s", 0.0), 1e-9)
                    for d, t in zip(runs[("diloco", rate)], runs[(PEER, rate)])]
            emit("slow_links", f"vs_torchft_diloco_{rate}", statistics.median(ratios), ">= 1.0",
                 range=[min(ratios), max(ratios)],
                 round_end_step_vs_torchft=round(statistics.median(ends), 3))
        if "sync" not in variants:
            continue
        sync = runs[("sync", rate)]
        for variant in [v for v in variants[1:] if v != PEER]:
            ratios = [d["samples_per_s"] / s["samples_per_s"]
                      for d, s in zip(runs[(variant, rate)], sync)]
            goal = ">= 10" if rate.startswith("10mbit") else ">= 3"
            emit("slow_links", f"samples_per_s_vs_sync_{variant}_{rate}",
                 statistics.median(ratios), goal, range=[min(ratios), max(ratios)])
        if "diloco_int8_streaming" not in variants:
            continue
        ratios = [d["link_bytes_per_step"] / s["link_bytes_per_step"]
                  for d, s in zip(runs[("diloco_int8_streaming", rate)], sync)]
        emit("slow_links", f"bytes_vs_sync_int8_streaming_{rate}", statistics.median(ratios),
             "<= 0.01", range=[min(ratios), max(ratios)])
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end")


def loss(rounds: int, variants: list[str]) -> None:
    steps = rounds * H
    results = {}
    for variant in ["sync", *[v for v in variants if v != "sync"]]:
        with tempfile.TemporaryDirectory() as tmp:
            rp.launch(train, num_replicas=4, args=(variant, steps, tmp, 2),
                      kwargs={"evaluate_at": (8 * H, steps)}, timeout_seconds=600)
            results[variant] = json.loads(Path(tmp, "rank0.json").read_text())["losses"]
    rows = [[v, results[v][str(8 * H)], results[v][str(steps)]] for v in results]
    print_table(["variant", f"held-out loss after 8 rounds ({8 * H} steps)",
                 f"after {rounds} rounds ({steps} steps)"], rows)
    sync = results["sync"]
    for variant in [v for v in results if v != "sync"]:
        gap = results[variant][str(steps)] / sync[str(steps)] - 1
        early = results[variant][str(8 * H)] / sync[str(8 * H)] - 1
        emit("slow_links", f"loss_gap_{variant}", gap, "<= 0.02", after_8_rounds=round(early, 4),
             loss=round(results[variant][str(steps)], 4), sync_loss=round(sync[str(steps)], 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", choices=(*VARIANTS, PEER), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=110, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--part", nargs="+", choices=("throughput", "loss"),
                        default=["throughput", "loss"])
    parser.add_argument("--rates", nargs="+", default=["10mbit", "100mbit"])
    parser.add_argument("--variants", nargs="+", choices=(*VARIANTS[:3], PEER),
                        default=["sync", "diloco", "diloco_int8_streaming", PEER],
                        help="throughput variants (sync first where it is one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--record", type=Path, default=None,
                        help="a JSON-lines file of finished throughput runs, reused by a rerun")
    parser.add_argument("--loss-variants", nargs="+", choices=VARIANTS[1:],
                        default=["diloco", "diloco_int4"])
    args = parser.parse_args()
    if args.worker == PEER:
        train_torchft(args.steps, args.out)
        return
    if args.worker:
        train(args.worker, args.steps, args.out)
        return
    if "throughput" in args.part:
        from tests.hosts import namespaces_unavailable

        why = namespaces_unavailable()
        if why:
            raise SystemExit(f"the throughput part needs network namespaces: {why}")
        throughput(args.rates, args.repeats, args.record, tuple(args.variants))
    if "loss" in args.part:
        loss(max(8, math.ceil(args.rounds)), args.loss_variants)


if __name__ == "__main__":
    main()
