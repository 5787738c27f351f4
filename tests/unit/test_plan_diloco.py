"""The planner knows DiLoCo: it predicts its step and the bytes on the link between hosts,
proposes an ``inner_steps`` and a compression, recommends it where per-step synchronisation
is link-bound and not where the link keeps up, and says why it cannot run on one host."""

import json
from pathlib import Path

import pytest

from replicator.cli import main
from replicator.comm.block_quantize import payload_bytes
from replicator.plan.devices import parse_link
from replicator.plan.formulas import (
    INNER_STEPS,
    allreduce_traffic_bytes,
    choose_outer_sync,
    exchange_cost,
)
from replicator.plan.profiles import MACHINE_VERSION, MachineProfile, save_json


def _plan(capsys, *args: str) -> dict[str, dict]:
    """``replicator plan --json ARGS`` by setting; CPU hosts with nominal figures (saved where
    the planner reads this machine's, so it does not measure them)."""
    out = args[args.index("--out") + 1]
    figures = {**MachineProfile.nominal().to_json(), "version": MACHINE_VERSION}
    save_json(Path(out) / "machine.json", figures)
    assert main(["plan", "--json", *args]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    return {line["setting"]: line for line in lines}


def test_a_slow_link_between_hosts_recommends_diloco_with_its_inner_steps(capsys, tmp_path):
    # the char transformer of benchmarks/slow_links.py: 2 hosts of 2 processes on 10 Mbit/s
    plan = _plan(capsys, "--model-params", "140000", "--global-batch", "64", "--seq-len", "64",
                 "--workers", "4", "--per-host", "2", "--link", "10mbit", "--latency", "1ms",
                 "--out", str(tmp_path))
    diloco, mirrored = plan["diloco x4"], plan["mirrored x4"]
    assert diloco["recommended"], diloco["reason"]
    assert diloco["spelling"].startswith("rp.DiLoCoStrategy(inner_steps=")
    assert "mirrored x4" in diloco["reason"] and "held-out loss" in diloco["reason"]
    assert diloco["predicted_samples_per_s"] > 3 * mirrored["predicted_samples_per_s"]
    # one exchange per round instead of an all-reduce per step
    assert diloco["link_bytes_per_step"] * 10 <= mirrored["link_bytes_per_step"]


def test_a_fast_link_keeps_per_step_synchronous_training(capsys, tmp_path):
    plan = _plan(capsys, "--model-params", "1e8", "--device", "h100", "--workers", "16",
                 "--link", "400gbit", "--out", str(tmp_path))
    chosen = [s for s, line in plan.items() if line["recommended"]]
    assert chosen and not chosen[0].startswith("diloco"), chosen
    assert plan["diloco x16"]["fits"]  # predicted, and not worth what it changes


def test_diloco_on_one_host_says_why_it_cannot_run(capsys, tmp_path):
    plan = _plan(capsys, "--model-params", "140000", "--workers", "2", "--per-host", "2",
                 "--out", str(tmp_path))
    line = plan["diloco x2"]
    assert not line["fits"] and line["predicted_step_s"] is None
    assert "across hosts" in line["reason"] and "--per-host" in line["reason"]
    plan = _plan(capsys, "--model-params", "140000", "--workers", "6", "--per-host", "4",
                 "--out", str(tmp_path))
    assert "same processes on every host" in plan["diloco x6"]["reason"]


def test_the_exchange_counts_one_copy_per_host_and_the_compressed_payload():
    link = parse_link("10mbit", 1e-3)
    params = 4 * 1_000_000
    seconds, sent = exchange_cost(params, 2, link, None, 1e10)
    assert sent == allreduce_traffic_bytes(params, 2)
    assert seconds >= sent / link.bandwidth
    _, sent8 = exchange_cost(params, 3, link, "int8", 1e10)
    _, sent4 = exchange_cost(params, 3, link, "int4", 1e10)
    assert sent8 == 2 * payload_bytes(1_000_000, 8) and sent4 == 2 * payload_bytes(1_000_000, 4)
    assert sent4 < sent8 < allreduce_traffic_bytes(params, 3) / 2


@pytest.mark.parametrize("rate", ["1mbit", "10mbit", "100mbit", "1gbit"])
def test_a_slower_link_never_gets_a_shorter_round_or_more_bits(rate):
    def choice(text: str):  # (H, bits) of the choice for a 10 ms inner step of 560 kB
        c = choose_outer_sync(0.01, 560e3, 2, parse_link(text, 1e-3), 1e10)
        return INNER_STEPS.index(c.inner_steps), {None: 0, "int8": 1, "int4": 2}[c.compression]

    faster = {"1mbit": "10mbit", "10mbit": "100mbit", "100mbit": "1gbit", "1gbit": "10gbit"}
    slow, fast = choice(rate), choice(faster[rate])
    assert slow >= fast, (rate, slow, fast)  # a longer round, or as long with fewer bits
