"""Running the replica-group training script (tests/scripts/live_train.py) from tests."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from replicator.launch.lighthouse import torchft_missing
from replicator.launch.script_launch import script_starter
from replicator.testing.live_groups import start_group, start_lighthouse

#: Live recovery runs on torchft (the ``live`` extra, in ``test``): without it these tests skip.
needs_torchft = pytest.mark.skipif(torchft_missing() is not None,
                                   reason="torchft not installed: pip install 'replicator[live]'")

SCRIPT = Path(__file__).resolve().parents[0] / "scripts" / "live_train.py"
SRC = str(Path(__file__).resolve().parents[1] / "src")


def env() -> dict[str, str]:
    return {"PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "REPLICATOR_LIVE_TIMEOUT_SECONDS": "20", "REPLICATOR_QUORUM_TIMEOUT_SECONDS": "120"}


#: one_device's parameters by its arguments: the same arguments train the same bits, so
#: tests that compare with the same run share one (made by the first of them).
_ONE_DEVICE: dict[tuple[str, ...], dict[str, torch.Tensor]] = {}


def one_device(tmp: Path, args: list[str]) -> dict[str, torch.Tensor]:
    """The parameters the script trains to with ``args`` on one device (the reference), forked
    from the warm forkserver as the groups are."""
    key = tuple(args)
    if key not in _ONE_DEVICE:
        out = tmp / "one_device"
        out.mkdir()
        full = dict(os.environ, **env())
        proc = script_starter(str(SCRIPT), ["--out", str(out), "--strategy", "one_device",
                                            *args]).start(0, full, quiet=True)
        proc.join(300)
        if proc.exitcode != 0:
            proc.kill()
            raise RuntimeError(f"the one-device reference run ended with {proc.exitcode}")
        _ONE_DEVICE[key] = torch.load(out / "final_g0.pt")
    return {name: value.clone() for name, value in _ONE_DEVICE[key].items()}


def run_groups(tmp: Path, name: str, args: list[str], *, groups: int = 3, min_replicas: int = 2,
               kills: dict[int, int] | None = None, restart: tuple[int, ...] = (),
               deadline: float = 400.0, nproc: int = 1, max_restarts: int = 1,
               extra: dict[int, list[str]] | None = None) -> dict:
    """Run ``groups`` replica groups; group g kills itself at step ``kills[g]``; the groups in
    ``restart`` are started again when killed (up to ``max_restarts`` times each), with the
    same arguments (``--kill-at-step`` excepted), unless a group has already finished (it
    would wait for peers that are gone, as a launcher knows). Returns each group's results."""
    out = tmp / name
    out.mkdir()
    kills = kills or {}
    extra = extra or {}
    lighthouse = start_lighthouse(min_replicas, log=out / "lighthouse.log")
    try:
        running = {}
        for g in range(groups):
            kill = ["--kill-at-step", str(kills[g])] if g in kills else []
            running[g] = start_group(SCRIPT, g, groups, lighthouse.address,
                                     min_replicas=min_replicas, env=env(), log_dir=out,
                                     nproc=nproc, args=["--out", str(out), *args, *kill,
                                                        "--start-together", str(groups),
                                                        *extra.get(g, [])])
        codes: dict[int, list[int]] = {g: [] for g in range(groups)}
        restarts = {g: 0 for g in range(groups)}
        end = time.monotonic() + deadline
        while running:
            if time.monotonic() > end:
                raise TimeoutError(f"groups {sorted(running)} still running after {deadline} s; "
                                   f"logs in {out}")
            for g, grp in list(running.items()):
                polled = grp.poll()
                if all(c is None for c in polled):
                    continue
                if any(c is None for c in polled) and all(c in (None, 0) for c in polled):
                    continue  # a rank finished first; the others follow
                if any(c is None for c in polled):  # a rank died: the group goes as a whole
                    grp.kill()
                code = next((c for c in grp.poll() if c != 0), 0)
                codes[g].append(code)
                del running[g]
                finished = any(0 in c for c in codes.values())  # the job is done
                if code == -signal.SIGKILL and g in restart and restarts[g] < max_restarts \
                        and not finished:
                    restarts[g] += 1
                    running[g] = start_group(SCRIPT, g, groups, lighthouse.address,
                                             min_replicas=min_replicas, env=env(),
                                             log_dir=out, nproc=nproc,
                                             args=["--out", str(out), *args,
                                                   *extra.get(g, [])])
            time.sleep(0.05)
    finally:
        for grp in running.values():
            grp.kill()
        lighthouse.stop()
    results = {}
    for g in range(groups):
        final = out / f"final_g{g}.pt"
        log = (out / f"group{g}_rank0.log").read_text(errors="replace")
        results[g] = {"codes": codes[g], "log": log,
                      "params": torch.load(final) if final.exists() else None,
                      "summary": json.loads((out / f"summary_g{g}.json").read_text())
                      if (out / f"summary_g{g}.json").exists() else None}
    return results




def diloco_round_by_hand(outer_model: torch.nn.Module, outer_opt: torch.optim.Optimizer,
                         inner: list, batches: list, x: torch.Tensor, y: torch.Tensor,
                         quantizers: list | None = None) -> None:
    """One DiLoCo round written out in one process, the reference of the live DiLoCo tests:
    each group's ``(model, inner optimizer)`` of ``inner`` starts from the outer weights and
    takes one step (MSE loss) per index tensor of its ``batches``; the outer optimizer steps
    with the mean of the groups' pseudo-gradients (outer minus inner weights). With
    ``quantizers`` (per group, a ``BlockQuantizer`` per process, each with its own error
    feedback), process ``k`` of each group encodes the ``k``-th of equal chunks of the flat
    pseudo-gradient and the payloads are decoded and summed in group order before the mean,
    as the compressed exchange does."""
    import torch.nn.functional as F

    outer = list(outer_model.parameters())
    deltas = []
    for (model, opt), steps in zip(inner, batches):
        with torch.no_grad():
            for p, o in zip(model.parameters(), outer):
                p.copy_(o)
        for idx in steps:
            F.mse_loss(model(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
        deltas.append([o.detach() - p.detach() for o, p in zip(outer, model.parameters())])
    if quantizers is None:
        mean = [sum(d[i] for d in deltas) / len(deltas) for i in range(len(outer))]
    else:
        flat = _quantised_mean([torch.cat([t.reshape(-1) for t in d]) for d in deltas],
                               quantizers)
        mean = [t.view_as(o) for t, o in zip(flat.split([o.numel() for o in outer]), outer)]
    for o, g in zip(outer, mean):
        o.grad = g
    outer_opt.step()


def _quantised_mean(flats: list, quantizers: list) -> torch.Tensor:
    """The mean of the groups' ``flats`` as the compressed exchange computes it: per chunk
    (one per process of a group, the last padded), each group's payload made by its
    quantizer of that chunk, decoded and summed in group order."""
    import math

    numel, chunks = flats[0].numel(), len(quantizers[0])
    size = math.ceil(numel / chunks)
    padded = [torch.cat([f, f.new_zeros(size * chunks - numel)]) for f in flats]
    out = []
    for k in range(chunks):
        payloads = [q[k].encode(p[k * size:(k + 1) * size], key="0")
                    for q, p in zip(quantizers, padded)]
        out.append(quantizers[0][k].decode_sum(payloads, size).div_(len(flats)))
    return torch.cat(out)[:numel]
