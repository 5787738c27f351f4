"""Small models and data shared by the tests, and the wait of a hung rank (module level, so
workers can import them)."""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn


def make_mlp(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 3))


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 2 * 2, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def make_cnn(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return SmallCNN()


def regression_data(n: int = 640, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 10, generator=g)
    y = (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()
    return torch.utils.data.TensorDataset(x, y)


def image_data(n: int = 640, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x.mean((1, 2, 3)) * 10).long().clamp(-4, 5) + 4
    return torch.utils.data.TensorDataset(x, y)


def hang(seconds: float, until: str | os.PathLike[str]) -> None:
    """Stay away like a hung rank: ``seconds``, or less once the file ``until`` exists. The
    rank that waits for this one writes it after it has given up, so the hang lasts past that
    rank's timeout however slow the machine is, and no test sleeps out the rest."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not os.path.exists(until):
        time.sleep(0.05)


def launch(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    """``rp.launch`` with the workers forked from a server that imported torch once
    (``start_method="forkserver"``): a launch of 3-5 processes starts in a fraction of a
    second instead of the seconds fresh interpreters take to import torch."""
    from replicator.launch import launch as cluster_launch

    kwargs.setdefault("start_method", "forkserver")
    return cluster_launch(fn, *args, **kwargs)


def run_cli(capfd, args: list[str], env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    """``replicator ARGS`` by the command line's own ``main`` in this process, its output read
    from the file descriptors (``capfd``): one fresh interpreter fewer per call, and the
    workers fork from this process's warm forkserver. Returns a ``CompletedProcess``."""
    import subprocess

    import pytest

    from replicator.cli import main

    capfd.readouterr()
    with pytest.MonkeyPatch.context() as patch:
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        try:
            code = main(args)
        except SystemExit as exc:  # argparse's --help and --version
            code = exc.code if isinstance(exc.code, int) else 1
    out = capfd.readouterr()
    return subprocess.CompletedProcess(["replicator", *args], code, out.out, out.err)


def shm_segments_made_by(pids: list[int]) -> list[str]:
    """The replicator shared-memory segments whose names say one of ``pids`` made them
    (``<prefix><tag>-<pid>-<id>``): a test on the other pytest-xdist worker may hold segments
    of its own meanwhile, so leak checks look at their own processes' alone."""
    import glob

    from replicator.comm.shm_segment import NAME_PREFIX, shm_dir

    return [path for pid in pids for path in glob.glob(f"{shm_dir()}/{NAME_PREFIX}*-{pid}-*")]


def child_processes(pid: int) -> list[tuple[int, str]]:
    """``(pid, command line)`` of the processes whose parent is ``pid`` (read from /proc)."""
    from pathlib import Path

    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append((int(entry.name), cmdline))
    return found
