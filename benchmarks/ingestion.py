"""Ingestion: JPEG decode + ImageNet-style augment, ours (AUTOTUNE, no knob) against torch's
DataLoader, and against the physical limit of this machine.

The images are made once from real photographs that ship with scikit-learn
(``load_sample_images``: random crops re-encoded as JPEG at sizes around 256x256, in 10 class
folders). Each sample is decoded and augmented as ImageNet training does: a random resized crop
to 224 (scale 0.08-1, ratio 3/4-4/3), a random flip, a float tensor normalised with ImageNet's
mean and std (PIL and torch ops). Batches of 64 feed a training step of a fixed cost (a
calibrated run of matrix products on one torch thread, so training holds one core).

- ``decode_limit``: images/s of decode + augment on one core (measured in this process) times
  the cores left to the input: the host's cores less the cores the step takes (its cost times
  the steps per second).
- ``autotune_vs_limit``: the loop's images/s with ours, no knob set / ``decode_limit`` (goal
  >= 0.9).
- ``autotune_vs_parallel_decode``: ours / images/s of the same decode + augment run by
  ``cores`` processes at once (nothing else of ours running), measured in each round: what the
  machine gives the input now. ``decode_limit`` assumes ``cores`` idle cores; on a host that
  other jobs load, two processes get less than two cores, and this figure shows how much of
  the gap to ``decode_limit`` is the host's (the load average is printed beside it).
- ``autotune_cpu_vs_decode``: images per CPU second of ours (this process and its workers over
  the timed batches) / of the one-core decode: what the pipeline's own work (collate, hand-over,
  the consumer) costs beside the decode, a figure the load of other jobs changes little.
- ``vs_dataloader_best``: ours / a DataLoader with the best ``num_workers`` of a sweep over
  0 .. cores (goal >= 1.0); ``vs_dataloader_default``: ours / DataLoader with
  ``num_workers=0`` (>= 2).
- ``vs_torchdata_nodes``, ``vs_webdataset``: ours / each peer reading the same images (the
  peer's ``num_workers`` set to the host's cores), where the peer imports
  (``pip install --no-deps torchdata==0.11 webdataset braceexpand``; MosaicML Streaming needs
  packages beyond ``--no-deps`` (brotli first) and is left out).
- ``first_batch_s``: seconds from a fresh pipeline's ``iter()`` to its first batch (<= 1).
- ``peak_rss_vs_ram_budget``: the largest resident set of this process and its workers over
  the default RAM budget (<= 1).
- ``s3_vs_local`` / ``s3_cached_vs_local``: images/s of the first epoch from the loopback S3
  server (moto) over an epoch of local shards (the better of two, workers started), and of
  the second S3 epoch, served from the local shard cache (>= 0.95). Skipped with ``--no-s3``.

Each round builds every variant afresh and times ``--batches`` batches after two (so no variant
starts with batches buffered while another ran); the rounds rotate the variants' order, so the
noise of a shared machine hits all alike; medians and ranges over the rounds are reported.
Sixteen timed batches (about 1.6 s of input per turn; four, the earlier default, gave
``autotune_vs_limit`` 0.70 to 1.15 between three quiet runs, sixteen 0.85 to 0.94).
Run: ``python benchmarks/ingestion.py [--images 512] [--batches 16] [--rounds 3] [--no-s3]``
"""

from __future__ import annotations

import argparse
import gc
import io
import math
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as MapDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._report import emit, median, print_table  # noqa: E402
from replicator.data import Dataset, Options, write_shards  # noqa: E402
from replicator.data.dataflow.options import available_cores  # noqa: E402

BENCH = "ingestion"
BATCH = 64
MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1) * 255
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1) * 255
_STEP = {"reps": 1}
_STEP_A = torch.randn(256, 256) / 256


# -- the data ------------------------------------------------------------------------------------
def make_images(folder: str, count: int, seed: int = 0) -> list[str]:
    """``count`` JPEGs cropped from scikit-learn's sample photographs (made once)."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    done = os.path.join(folder, f".done-{count}")
    paths = [os.path.join(folder, str(i % 10), f"{i:05d}.jpg") for i in range(count)]
    if os.path.exists(done):
        return paths
    photos = [Image.fromarray(a) for a in load_sample_images().images]
    rng = random.Random(seed)
    for i, path in enumerate(paths):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        photo = photos[i % len(photos)]
        side = rng.randint(200, 320)
        w, h = min(side, photo.width), min(int(side * rng.uniform(0.75, 1.33)), photo.height)
        x, y = rng.randint(0, photo.width - w), rng.randint(0, photo.height - h)
        photo.crop((x, y, x + w, y + h)).save(path, "JPEG", quality=rng.randint(80, 95))
    open(done, "w").close()
    return paths


def augment(data: bytes, label: int) -> tuple[torch.Tensor, int]:
    """Decode, random resized crop to 224, random flip, normalise (ImageNet training)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        im = im.convert("RGB")
    w, h = im.size
    box = (0, 0, w, h)
    for _ in range(10):
        area = w * h * random.uniform(0.08, 1.0)
        ratio = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = random.randint(0, w - cw), random.randint(0, h - ch)
            box = (x, y, x + cw, y + ch)
            break
    im = im.resize((224, 224), Image.BILINEAR, box=box)
    if random.random() < 0.5:
        im = im.transpose(Image.FLIP_LEFT_RIGHT)
    t = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(224, 224, 3)
    return (t.permute(2, 0, 1).float() - MEAN) / STD, label


def load_path(path: str) -> tuple[torch.Tensor, int]:
    with open(path, "rb") as f:
        return augment(f.read(), int(os.path.basename(os.path.dirname(path))))


def load_sample(sample: dict) -> tuple[torch.Tensor, int]:
    return augment(sample["jpg"], int(sample["cls"]))


class Images(MapDataset):
    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return load_path(self.paths[i])


# -- the loop ------------------------------------------------------------------------------------
def step() -> None:
    x = _STEP_A
    for _ in range(_STEP["reps"]):
        x = x @ _STEP_A


def calibrate_step(ms: float) -> None:
    start = time.perf_counter()
    for _ in range(50):
        x = _STEP_A @ _STEP_A
    per = (time.perf_counter() - start) / 50
    del x
    _STEP["reps"] = max(1, round(ms / 1000 / per))


def cpu_seconds() -> float:
    """CPU seconds of this process and its children: those that ended (and were waited for)
    and the live ones (workers; Linux's /proc)."""
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    total, me = time.process_time() + ended.ru_utime + ended.ru_stime, str(os.getpid())
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[1] == me:
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def rate(batches: Iterable[Any], warm: int, timed: int) -> tuple[float, float]:
    """Images/s of the loop (input + step) over ``timed`` batches after ``warm`` ones, and
    images per CPU second of this process and its workers over them (what the load of other
    jobs changes least)."""
    it = iter(batches)
    for _ in range(warm):
        next(it)
        step()
    start, cpu, images = time.perf_counter(), cpu_seconds(), 0
    for _ in range(timed):
        x, _y = next(it)
        images += int(x.shape[0])
        step()
    return images / (time.perf_counter() - start), images / max(1e-3, cpu_seconds() - cpu)


def endless(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        yield from loader


def ours(paths: list[str]) -> Dataset:
    return (Dataset.list_files(paths).repeat().shuffle(len(paths), seed=0).map(load_path)
            .batch(BATCH, drop_remainder=True).prefetch())


def decode_limit(paths: list[str], cores: int) -> tuple[float, float, float]:
    """Images/s of decode + augment on one core, times ``cores``, and images per CPU second."""
    sample = paths[:96]
    start, cpu = time.perf_counter(), time.process_time()
    for p in sample:
        load_path(p)
    one = len(sample) / (time.perf_counter() - start)
    return one, one * cores, len(sample) / max(1e-3, time.process_time() - cpu)


def _decode_part(paths: list[str], ready: Any, spans: Any) -> None:
    torch.set_num_threads(1)
    ready.wait(60)
    start = time.perf_counter()  # CLOCK_MONOTONIC: comparable across the processes
    for p in paths:
        load_path(p)
    spans.put((start, time.perf_counter()))


def parallel_decode(paths: list[str], cores: int, per: int = 96) -> float:
    """Images/s of decode + augment by ``cores`` processes at once (each ``per`` images), timed
    from a common start to the last one's end (their start and exit are not counted)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    ready, spans = ctx.Barrier(cores + 1), ctx.Queue()
    procs = [ctx.Process(target=_decode_part, args=(
        [paths[(i * per + j) % len(paths)] for j in range(per)], ready, spans))
        for i in range(cores)]
    for proc in procs:
        proc.start()
    ready.wait(60)
    got = [spans.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(60)
    return cores * per / (max(e for _s, e in got) - min(s for s, _e in got))


def load_average() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "unknown"


def peak_rss() -> int:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) * 1024


# -- S3 ------------------------------------------------------------------------------------------
def s3_figures(paths: list[str], folder: str) -> tuple[float, float, float]:
    """Images/s of an epoch from local shards, the first from S3, a later one from the cache."""
    from tests.s3_server import S3Server

    server = S3Server(os.path.join(folder, "moto.log"))
    server.start()
    os.environ.update(server.env)
    try:
        server.make_bucket("ingestion")

        def samples() -> Iterator[dict]:
            for i, p in enumerate(paths):
                with open(p, "rb") as f:
                    yield {"__key__": f"{i:06d}", "jpg": f.read(),
                           "cls": int(os.path.basename(os.path.dirname(p)))}
        local = write_shards(samples(), os.path.join(folder, "shards", "train"), 64)
        remote = write_shards(samples(), "s3://ingestion/train", 64)

        def epoch(ds: Dataset) -> float:
            start, images = time.perf_counter(), 0
            for x, _y in ds:
                images += int(x.shape[0])
                step()
            return images / (time.perf_counter() - start)

        def pipeline(urls: list[str]) -> Dataset:
            return (Dataset.from_shards(urls, cache_dir=os.path.join(folder, "cache"))
                    .map(load_sample).batch(BATCH, drop_remainder=True).prefetch())
        local_ds, remote_ds = pipeline(local), pipeline(remote)
        local_rate, first = epoch(local_ds), epoch(remote_ds)
        local_rate = max(local_rate, epoch(local_ds))  # both with started workers
        cached = epoch(remote_ds)
        local_ds.close()
        remote_ds.close()
        return local_rate, first, cached
    finally:
        server.stop()


# -- peers (each only where it imports: pip install --no-deps never replaces torch) ------------
def torchdata_nodes(paths: list[str], workers: int) -> Iterable[Any] | None:
    try:
        import torchdata.nodes as tn
    except ImportError:
        return None
    from torch.utils.data import RandomSampler, default_collate

    node = tn.SamplerWrapper(RandomSampler(range(len(paths))))
    node = tn.ParallelMapper(node, map_fn=_PathAt(paths), num_workers=workers,
                             method="process", in_order=True)
    node = tn.Mapper(tn.Batcher(node, BATCH, drop_last=True), default_collate)
    return tn.Loader(tn.Prefetcher(node, 2), restart_on_stop_iteration=True)


class _PathAt:
    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __call__(self, i: int) -> tuple[torch.Tensor, int]:
        return load_path(self.paths[i])


def webdataset_loader(shards: list[str], workers: int) -> Iterable[Any] | None:
    try:
        import webdataset as wds
    except ImportError:
        return None
    ds = (wds.WebDataset(shards, shardshuffle=False, empty_check=False)
          .shuffle(1000).map(load_sample).batched(BATCH, partial=False))
    return wds.WebLoader(ds, batch_size=None, num_workers=workers,
                         persistent_workers=workers > 0)


def wds_shards(paths: list[str], folder: str) -> list[str]:
    """The images as tar shards (made once), for the readers of shards."""
    wds_dir = os.path.join(folder, f"wds-{len(paths)}")
    if os.path.isdir(wds_dir):
        return sorted(os.path.join(wds_dir, f) for f in os.listdir(wds_dir))

    def samples() -> Iterator[dict]:
        for i, p in enumerate(paths):
            with open(p, "rb") as f:
                yield {"__key__": f"{i:06d}", "jpg": f.read(),
                       "cls": int(os.path.basename(os.path.dirname(p)))}
    return write_shards(samples(), os.path.join(wds_dir, "train"), 64)


def variants(paths: list[str], folder: str, cores: int) -> dict[str, Any]:
    """Each variant's builder: a fresh loader per round (no batches buffered from before)."""
    def loader(workers: int) -> Any:
        return lambda: endless(DataLoader(Images(paths), batch_size=BATCH, shuffle=True,
                                          drop_last=True, num_workers=workers))
    out: dict[str, Any] = {"ours": lambda: ours(paths)}
    out.update({f"DataLoader num_workers={w}": loader(w) for w in range(cores + 1)})
    if torchdata_nodes(paths, 1) is not None:
        out["torchdata_nodes"] = lambda: endless(torchdata_nodes(paths, cores))  # type: ignore
    shards = wds_shards(paths, folder)
    if webdataset_loader(shards, 0) is not None:
        out["webdataset"] = lambda: endless(webdataset_loader(shards, cores))  # type: ignore
    return out


def measure(build: Any, warm: int, timed: int) -> tuple[tuple[float, float], float, dict]:
    """((images/s, images per CPU second), seconds to the first batch, the pipeline's stats
    if ours)."""
    start = time.perf_counter()
    source = build()
    it = iter(source)
    next(it)
    first = time.perf_counter() - start
    r = rate(it, warm, timed)
    stats = source.stats() if isinstance(source, Dataset) else {}
    if isinstance(source, Dataset):
        source.close()
    del it, source
    gc.collect()  # a peer's workers are gone before the next variant forks its own
    return r, first, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--batches", type=int, default=16, help="timed batches per turn")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--data", default=os.path.join(tempfile.gettempdir(),
                                                       "replicator-ingestion"))
    parser.add_argument("--no-s3", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    calibrate_step(args.step_ms)
    paths = make_images(os.path.join(args.data, "jpeg"), args.images)
    cores = available_cores()
    builders = variants(paths, args.data, cores)
    rates: dict[str, list[float]] = {name: [] for name in builders}
    per_cpu: dict[str, list[float]] = {name: [] for name in builders}
    firsts, one_core, one_per_cpu, together, stats = [], [], [], [], {}
    loads = [load_average()]
    for r in range(args.rounds):  # rounds alternate the variants, so noise hits all alike
        one, _, cpu = decode_limit(paths, 1)
        one_core.append(one)
        one_per_cpu.append(cpu)
        together.append(parallel_decode(paths, cores))
        names = list(builders)[r % len(builders):] + list(builders)[:r % len(builders)]
        for name in names:
            (got, cpu), first, st = measure(builders[name], 2, args.batches)
            print(f"round {r}: {name}: {got:.1f} images/s, {cpu:.1f} per CPU s", flush=True)
            rates[name].append(got)
            per_cpu[name].append(cpu)
            if name == "ours":
                firsts.append(first)
                stats = st
    med = {name: median(v) for name, v in rates.items()}
    training = args.step_ms / 1000 * med["ours"] / BATCH  # cores the step takes
    limit = median(one_core) * (cores - training)
    loaders = {n: v for n, v in med.items() if n.startswith("DataLoader")}
    best = max(loaders, key=loaders.get)  # type: ignore[arg-type]
    rss, ram = peak_rss(), Options().ram
    loads.append(load_average())
    rows = [["decode + augment, 1 core", median(one_core), _range(one_core),
             median(one_per_cpu)],
            [f"decode_limit ({cores} - {training:.2f} cores)", limit, "", ""],
            [f"decode + augment, {cores} processes at once", median(together),
             _range(together), ""]]
    rows += [[n, med[n], _range(v), median(per_cpu[n])] for n, v in rates.items()]
    s3 = None if args.no_s3 else s3_figures(paths, args.data)
    if s3 is not None:
        rows += [["shards, local", s3[0], "", ""], ["shards, S3 first epoch", s3[1], "", ""],
                 ["shards, S3 from cache", s3[2], "", ""]]
    print_table(["variant", "images/s (median)", "range", "images per CPU s"], rows)
    stage = next(iter(stats["stages"].values()))
    print(f"ours: {stats['pipeline']}; parallelism {stage['parallelism']} of "
          f"{stage['max_parallelism']}, task {stage['task_ms']:.0f} ms; first batch "
          f"{median(firsts):.2f} s; peak RSS {rss / 2**20:.0f} MiB of {ram / 2**20:.0f} MiB")
    print(f"load average (1, 5, 15 min) at the start: {loads[0]}; at the end: {loads[1]} "
          f"({cores} cores)")
    emit(BENCH, "autotune_vs_limit", med["ours"] / limit, ">= 0.9", cores=cores)
    emit(BENCH, "autotune_vs_parallel_decode", med["ours"] / median(together), ">= 0.9",
         load=loads[1])
    emit(BENCH, "autotune_cpu_vs_decode", median(per_cpu["ours"]) / median(one_per_cpu),
         ">= 0.9")
    emit(BENCH, "vs_dataloader_best", med["ours"] / med[best], ">= 1.0", best=best)
    emit(BENCH, "vs_dataloader_default", med["ours"] / med["DataLoader num_workers=0"],
         ">= 2.0")
    for name in ("torchdata_nodes", "webdataset"):
        if name in med:
            emit(BENCH, f"vs_{name}", med["ours"] / med[name], ">= 1.0", num_workers=cores)
    emit(BENCH, "first_batch_s", median(firsts), "<= 1.0")
    emit(BENCH, "peak_rss_vs_ram_budget", rss / ram, "<= 1.0")
    if s3 is not None:
        emit(BENCH, "s3_vs_local", s3[1] / s3[0], ">= 0.8")
        emit(BENCH, "s3_cached_vs_local", s3[2] / s3[0], ">= 0.95")


def _range(values: list[float]) -> str:
    return f"{min(values):.4g}-{max(values):.4g}"


if __name__ == "__main__":
    main()
