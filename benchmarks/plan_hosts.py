"""``replicator plan``'s network term against two hosts joined by a throttled link.

Two network hosts (network namespaces on a bridge, from tests/hosts.py, each link limited with
``tc tbf`` to ``--rate``, with a token bucket of at least 10 ms of traffic) run 2 processes
each: ``replicator run --nnodes 2`` of ``examples/plan_models.py`` under the bench's probe
with ``MultiWorkerMirroredStrategy`` (hierarchical all-reduce: shared memory inside a host,
a ring between the hosts). The measured mean step is compared with the plan's prediction for
2 hosts of 2 processes on that link.

The four processes share this machine's 2 cores, which real hosts would not: the prediction
therefore takes compute, input and optimizer as 4 processes on one host (the measured
contention) and communication and synchronisation as 2 hosts of 2 on the link.

Run (root, for the namespaces): ``python benchmarks/plan_hosts.py [--rates 200mbit 1gbit]
[--model mlp] [--steps 10]``; it reuses ``bench/machine.json`` and the script's profile (or
makes them).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "src"))

from benchmarks._report import emit, print_table  # noqa: E402

SCRIPT = str(ROOT / "examples" / "plan_models.py")


def _measure(rate: str, model: str, steps: int, warmup: int, port: int) -> dict:
    """Run the script on two throttled hosts; return the bench's summary of the run."""
    from replicator.plan import probe
    from replicator.plan.benchmark import ENTRY, Setting, _read_ranks, summarize
    from replicator.plan.devices import parse_link
    from tests.hosts import virtual_hosts

    with virtual_hosts(2) as net, tempfile.TemporaryDirectory() as tmp:
        bits = parse_link(rate).bandwidth * 8
        net.limit_rate(rate, burst=f"{max(256, int(bits / 8 / 1024 / 100))}kb")  # >= 10 ms
        out = Path(tmp) / "bench"
        out.mkdir()
        env = {"TMPDIR": tmp, probe.STRATEGY_ENV: "multi_worker_mirrored",
               probe.OUT_ENV: str(out), probe.STEPS_ENV: str(steps),
               probe.WARMUP_ENV: str(warmup), probe.MODE_ENV: "bench",
               "REPLICATOR_COMM_TIMING": "1", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
        procs = [h.popen([sys.executable, "-m", "replicator.cli", "run", "--nnodes", "2",
                          "--node-rank", str(h.index), "--master-addr", net.hosts[0].address,
                          "--master-port", str(port), "--nproc-per-node", "2", "--timeout",
                          "300", "--quiet-workers", ENTRY, SCRIPT, "--model", model], env=env)
                 for h in net.hosts]
        for proc in procs:
            if proc.wait(timeout=1800) != 0:
                raise SystemExit(f"the {rate} run failed (exit code {proc.returncode}); "
                                 f"logs in {out}")
        result = summarize(Setting("multi_worker_mirrored", 4), _read_ranks(out))
        if not result.ok:
            raise SystemExit(f"the {rate} run measured nothing: {result.error}")
        return {"step": result.step_seconds, "breakdown": result.breakdown}


def _predict(rate: str, model_name: str, out_dir: str) -> dict:
    from replicator.plan.cost_model import Cluster, predict
    from replicator.plan.devices import get_device, parse_link
    from replicator.plan.planner import load_machine, profile_script

    model = profile_script(SCRIPT, ["--model", model_name], out_dir=out_dir)
    machine = load_machine(out_dir)
    cpu, link = get_device("cpu"), parse_link(rate)
    local = predict("mirrored", 4, model, Cluster(cpu, link, machine, ranks_per_host=4))
    hosts = predict("mirrored", 4, model, Cluster(cpu, link, machine, ranks_per_host=2))
    parts = dict(local.breakdown)
    parts["communication"] = hosts.breakdown["communication"]
    parts["overhead"] = hosts.breakdown["overhead"]
    return {"step": sum(parts.values()), "breakdown": parts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", nargs="+", default=["200mbit", "1gbit"])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default="bench", help="where machine.json and profiles live")
    args = parser.parse_args()
    from tests.hosts import namespaces_unavailable

    why = namespaces_unavailable()
    if why:
        raise SystemExit(f"benchmarks/plan_hosts.py needs network namespaces: {why}")
    rows, lines = [], []
    for i, rate in enumerate(args.rates):
        predicted = _predict(rate, args.model, args.out)
        measured = _measure(rate, args.model, args.steps, args.warmup, 29600 + i)
        error = (predicted["step"] - measured["step"]) / measured["step"]
        rows.append([rate, args.model, predicted["step"] * 1e3, measured["step"] * 1e3,
                     predicted["breakdown"]["communication"] * 1e3,
                     measured["breakdown"]["communication"] * 1e3, f"{error:+.0%}"])
        lines.append((rate, error, predicted, measured))
    print_table(["link", "model", "predicted ms", "measured ms", "predicted comm ms",
                 "measured comm ms", "error"], rows)
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the end")
    for rate, error, predicted, measured in lines:
        emit("plan_hosts", f"step_error_{rate}", abs(error), "<= 0.2",
             predicted_ms=round(predicted["step"] * 1e3, 2),
             measured_ms=round(measured["step"] * 1e3, 2),
             measured_breakdown_ms={k: round(v * 1e3, 2)
                                    for k, v in measured["breakdown"].items()})


if __name__ == "__main__":
    main()
