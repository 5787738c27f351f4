"""Running the replica-group training script (tests/scripts/live_train.py) from tests."""

from __future__ import annotations

import copy
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


def _quantised_mean(flats: list, quantizers: list, key: str = "0") -> torch.Tensor:
    """The mean of the groups' ``flats`` as the compressed exchange computes it: per chunk
    (one per process of a group, the last padded), each group's payload made by its
    quantizer of that chunk, decoded and summed in group order."""
    import math

    numel, chunks = flats[0].numel(), len(quantizers[0])
    size = math.ceil(numel / chunks)
    padded = [torch.cat([f, f.new_zeros(size * chunks - numel)]) for f in flats]
    out = []
    for k in range(chunks):
        payloads = [q[k].encode(p[k * size:(k + 1) * size], key=key)
                    for q, p in zip(quantizers, padded)]
        out.append(quantizers[0][k].decode_sum(payloads, size).div_(len(flats)))
    return torch.cat(out)[:numel]


def streaming_diloco_by_hand(committed: dict[tuple[int, int], dict[int, list[int]]],
                             healed_at: int, fragments: int, *, steps: int = 24, h: int = 4,
                             delay: int = 0, samples: int = 64, bits: int | None = None,
                             error_feedback: bool = True, nproc: int = 2
                             ) -> dict[int, dict[str, torch.Tensor]]:
    """Streaming DiLoCo written out in one process over the batches each group committed, as
    replica groups run it: a round of ``h / fragments`` steps ends with one fragment's
    exchange (fragment f after inner steps (f + 1) h / fragments, modulo h); the groups present
    average that fragment's pseudo-gradient (taken ``delay`` steps before the round's end),
    its own outer Nesterov SGD (0.7, 0.9) steps, and every present group's copy of the
    fragment takes the new outer weights (the steps since the pseudo-gradient was taken are
    lost to it) while the other fragments go on from where they are. Group 1, back at round
    ``healed_at``, takes group 0's inner weights and Adam state there (a peer's state at a
    round's start; as every group resuming there from group 0's backup does). With ``bits``,
    each fragment's pseudo-gradients are quantised as the compressed exchange does (one chunk
    per process of a group, ``nproc``, each process's error feedback, unless
    ``error_feedback=False``, kept per fragment; the healed group's start from zero).
    Returns each group's weights at the end (the fragments not exchanged last differ between
    groups)."""
    from replicator.comm.block_quantize import BlockQuantizer
    from replicator.strategies.two_level.fragments import Schedule, split_fragments
    from tests.scripts.diloco_live_train import build_model, dataset

    x, y, _ = dataset(samples).tensors
    outer_model = build_model()
    params = list(outer_model.parameters())
    parts = split_fragments(params, fragments)
    outer_opts = [torch.optim.SGD([params[i] for i in part], lr=0.7, momentum=0.9,
                                  nesterov=True) for part in parts]
    schedule = Schedule(h, fragments, 0)
    inner: dict[int, tuple[torch.nn.Module, torch.optim.Optimizer]] = {}
    quantizers: dict[int, list] = {}
    length = h // fragments
    for start in range(0, steps, length):
        groups = sorted({g for (g, _), done in committed.items() if start in done})
        for g in groups:
            if g not in inner:
                model = build_model()
                inner[g] = (model, torch.optim.Adam(model.parameters(), lr=0.01))
            if g == 1 and start == healed_at:
                inner[1][0].load_state_dict(copy.deepcopy(inner[0][0].state_dict()))
                inner[1][1].load_state_dict(copy.deepcopy(inner[0][1].state_dict()))
            if bits is not None and (g not in quantizers or (g == 1 and start == healed_at)):
                quantizers[g] = [BlockQuantizer(bits, error_feedback=error_feedback)
                                 for _ in range(nproc)]
        (fragment,) = schedule.applied(start + length)
        for step in range(start, start + length):
            if step == start + length - delay:  # the exchange starts: the pseudo-gradient
                mean = [sum(params[i].detach() - list(inner[g][0].parameters())[i].detach()
                            for g in groups) / len(groups) for i in parts[fragment]]
            for g in groups:
                model, opt = inner[g]
                idx = torch.tensor([i for (gg, _), done in sorted(committed.items())
                                    if gg == g for i in done[step]])
                torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
                opt.step()
                opt.zero_grad()
        if delay == 0 and bits is None:
            mean = [sum(params[i].detach() - list(inner[g][0].parameters())[i].detach()
                        for g in groups) / len(groups) for i in parts[fragment]]
        elif delay == 0:
            flats = [torch.cat([(params[i].detach() - list(inner[g][0].parameters())[i].detach())
                                .reshape(-1) for i in parts[fragment]]) for g in groups]
            flat = _quantised_mean(flats, [quantizers[g] for g in groups], key=str(fragment))
            mean = [t.view_as(params[i]) for t, i in
                    zip(flat.split([params[i].numel() for i in parts[fragment]]), parts[fragment])]
        for i, grad in zip(parts[fragment], mean):
            params[i].grad = grad
        outer_opts[fragment].step()
        with torch.no_grad():
            for g in groups:
                mine = list(inner[g][0].parameters())
                for i in parts[fragment]:
                    params[i].grad = None
                    mine[i].copy_(params[i])
    return {g: {k: v.detach().clone() for k, v in model.state_dict().items()}
            for g, (model, _) in inner.items()}
