"""Refused before any worker starts: a demo strategy that cannot run the demo, and more
workers than the machine's memory holds (with the arithmetic), unless ``--force``."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from replicator.cli import main
from replicator.demo.options import DEMO_STRATEGIES, strategy_refusal
from replicator.launch import memory_budget
from replicator.launch.memory_budget import WORKER_BYTES, available_memory, memory_refusal

CLI = [sys.executable, "-m", "replicator.cli"]


@pytest.fixture
def _cli(capfd) -> Callable[..., subprocess.CompletedProcess]:
    """``_cli(*args)``: ``replicator ARGS`` by the command line's own main in this process (the
    refusals come before anything starts: no fresh interpreter needed), its code and output."""
    def run(*args: str) -> subprocess.CompletedProcess:
        capfd.readouterr()
        code = main(list(args))
        out = capfd.readouterr()
        return subprocess.CompletedProcess([*CLI, *args], code, out.out, out.err)

    return run


@pytest.mark.parametrize("name", ["pipeline", "pp", "mesh", "one_device"])
def test_demo_refuses_strategies_it_cannot_run_and_says_what_works(name: str, _cli) -> None:
    out = _cli("demo", "--strategy", name)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"replicator demo: error: --strategy {name} cannot run the demo")
    assert "the demo runs with: mirrored (the default)" in out.stderr
    assert "[rank" not in out.stderr + out.stdout  # no worker was started


def test_demo_strategy_rules() -> None:
    assert strategy_refusal("one_device", 1) is None and strategy_refusal("mirrored", 4) is None
    assert "--num-ps 1" in (strategy_refusal("parameter_server", 3) or "")
    assert strategy_refusal("ps", 3, num_ps=1) is None
    assert "is not a strategy name" in (strategy_refusal("mirroed", 2) or "")
    assert set(DEMO_STRATEGIES) >= {"mirrored", "central_storage", "parameter_server"}


def test_more_workers_than_memory_holds_is_refused_with_the_arithmetic() -> None:
    gb = 1024 ** 3
    text = memory_refusal(40, (4 * gb, "MemAvailable in /proc/meminfo")) or ""
    assert text.startswith("--nproc 40 needs about 11.7 GB (40 workers x ~300 MB each")
    assert "only 4.0 GB is available (MemAvailable in /proc/meminfo), which holds 13 " in text
    assert "use --nproc 13 or fewer, or add --force" in text
    assert memory_refusal(13, (4 * gb, "x")) is None
    assert memory_refusal(10 ** 6, None) is None  # unknown: nothing to check against
    assert "free some memory first" in (memory_refusal(2, (WORKER_BYTES - 1, "x")) or "")


def test_available_memory_reads_meminfo_and_a_container_limit(tmp_path) -> None:
    (tmp_path / "meminfo").write_text("MemTotal: 8000000 kB\nMemAvailable: 2048 kB\n")
    assert memory_budget._meminfo_available(str(tmp_path / "meminfo")) == 2048 * 1024
    (tmp_path / "memory.max").write_text("1000000\n")
    (tmp_path / "memory.current").write_text("400000\n")
    assert memory_budget._cgroup_left(str(tmp_path)) == 600000
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_budget._cgroup_left(str(tmp_path)) is None
    found = available_memory()
    assert found is None or (found[0] > 0 and found[1])


def test_replicator_run_refuses_too_many_workers_unless_forced(tmp_path, _cli) -> None:
    out = _cli("run", "--nproc", "100000", str(tmp_path / "train.py"))
    assert out.returncode == 2 and "--nproc 100000 needs about" in out.stderr, out.stderr
    assert "add --force" in out.stderr
    forced = _cli("run", "--nproc", "100000", "--force", str(tmp_path / "train.py"))
    assert forced.returncode == 2 and "not found" in forced.stderr  # past the memory check
    assert "needs about" not in forced.stderr
