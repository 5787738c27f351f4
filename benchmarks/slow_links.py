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
  Medians of ``--repeats`` runs, with their ranges.
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
    for step, batch in enumerate(data, start=1):
        strategy.run(step_fn, args=(batch,))
        if step == warm:
            started, link = time.perf_counter(), _host_bytes() if hosts is None else 0
        if step in evaluate_at and strategy.is_chief:
            record["losses"][step] = _held_out_loss(model)
    record["samples_per_s"] = (steps - warm) * GLOBAL_BATCH / (time.perf_counter() - started)
    if hosts is None and local_first:
        record["link_bytes_per_step"] = (_host_bytes() - link) / (steps - warm)
    rank = int(os.environ.get("RANK", "0"))
    if local_first:
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    strategy.close()


# -- the parent ---------------------------------------------------------------------------------
def _throughput_run(variant: str, rate: str, steps: int, port: int) -> dict[str, float]:
    from tests.hosts import virtual_hosts

    with virtual_hosts(2) as net, tempfile.TemporaryDirectory() as tmp:
        bits = float(rate.lower().removesuffix("mbit")) * 1e6
        net.limit_rate(rate, burst=f"{max(256, int(bits / 8 / 1024 / 100))}kb")
        env = {"TMPDIR": tmp, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        procs = [h.popen([sys.executable, "-m", "replicator.cli", "run", "--nnodes", "2",
                          "--node-rank", str(h.index), "--master-addr", net.hosts[0].address,
                          "--master-port", str(port), "--nproc-per-node", "2", "--timeout",
                          "600", "--quiet-workers", __file__, "--worker", variant,
                          "--steps", str(steps), "--out", tmp],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for h in net.hosts]
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"{variant} at {rate} failed:\n" + "\n".join(logs)[-3000:])
        records = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
    return {"samples_per_s": records[0]["samples_per_s"],
            "link_bytes_per_step": sum(r["link_bytes_per_step"] for r in records)}


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.4g} [{min(values):.4g}, {max(values):.4g}]"


def throughput(rates: list[str], repeats: int, record: Path | None) -> None:
    """``record``: a JSON-lines file of finished runs, kept and reused (a rerun goes on)."""
    variants = ("sync", "diloco", "diloco_int8_streaming")
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
    rows = []
    for (variant, rate), results in runs.items():
        rows.append([variant, rate, _summary([r["samples_per_s"] for r in results]),
                     _summary([r["link_bytes_per_step"] / 1e3 for r in results])])
    print_table(["variant", "link", "samples/s median [range]", "link kB/step (both hosts)"],
                rows)
    for rate in rates:
        sync = runs[("sync", rate)]
        for variant in variants[1:]:
            ratios = [d["samples_per_s"] / s["samples_per_s"]
                      for d, s in zip(runs[(variant, rate)], sync)]
            goal = ">= 10" if rate.startswith("10mbit") else ">= 3"
            emit("slow_links", f"samples_per_s_vs_sync_{variant}_{rate}",
                 statistics.median(ratios), goal, range=[min(ratios), max(ratios)])
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
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=110, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--part", nargs="+", choices=("throughput", "loss"),
                        default=["throughput", "loss"])
    parser.add_argument("--rates", nargs="+", default=["10mbit", "100mbit"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--record", type=Path, default=None,
                        help="a JSON-lines file of finished throughput runs, reused by a rerun")
    parser.add_argument("--loss-variants", nargs="+", choices=VARIANTS[1:],
                        default=["diloco", "diloco_int4"])
    args = parser.parse_args()
    if args.worker:
        train(args.worker, args.steps, args.out)
        return
    if "throughput" in args.part:
        from tests.hosts import namespaces_unavailable

        why = namespaces_unavailable()
        if why:
            raise SystemExit(f"the throughput part needs network namespaces: {why}")
        throughput(args.rates, args.repeats, args.record)
    if "loss" in args.part:
        loss(max(8, math.ceil(args.rounds)), args.loss_variants)


if __name__ == "__main__":
    main()
