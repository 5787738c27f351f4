"""Sharded checkpoints of model-parallel runs through ``torch.distributed.checkpoint`` (DCP).

Each rank writes only the shards it holds (FSDP shards, tensor-parallel slices, its pipeline
stages), in safetensors files through DCP's ``HuggingFaceStorageWriter`` (no pickle: DCP's
default ``.metadata`` file is a pickle, which replicator refuses to load). Tensors are named
by the model's own parameter names (``get_state_dict``), so a checkpoint saved in one layout
loads into any other: data x pipeline into FSDP, tensor parallel into one device.

The commit is the checkpoint room's: every rank writes into ``.tmp-step-N-aK``, the ranks
agree that all writes succeeded, then the chief hashes every file, renames the directory to
``step-N`` and writes ``COMMIT.json`` (SHA-256 of each file) last. Loading verifies the
marker and every hash first and skips partial or damaged checkpoints.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from replicator.checkpoint.atomic import fsync_dir, hash_file, remove_tree, write_durable
from replicator.checkpoint.exchange import Channel, describe_failures, group_collectives
from replicator.checkpoint.manifest import (
    MARKER_NAME,
    FileEntry,
    build,
    read_marker,
    verify,
    write_marker,
)
from replicator.checkpoint.store import check_location, is_remote, local_path
from replicator.cluster.environment import resolve_cluster
from replicator.comm.collectives import Collectives
from replicator.errors import CheckpointCorruptError, CheckpointWriteError, StorageURLError

GROUPS_FILE = "optimizer_groups.json"
_STEP_PREFIX = "step-"

#: One optimizer, several (of one model, e.g. one per parameter group), or none.
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def _as_list(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    return list(optimizer)


def _step_dir(step: int) -> str:
    return f"{_STEP_PREFIX}{step:08d}"


def _held(t: Any) -> bool:
    """True for a tensor this rank holds (pipeline ranks leave other stages' tensors empty)."""
    if not isinstance(t, torch.Tensor):
        return False
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() > 0


def _flat_state(msd: dict[str, Any], osd: dict[str, Any], optimizer: bool
                ) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """``model.<fqn>`` and ``optim.<fqn>.<key>`` tensors this rank holds (the same tensor
    objects as in the state dicts); the optimizer's param groups as JSON."""
    flat = {f"model.{k}": v for k, v in msd.items() if _held(v)}
    groups: list[dict[str, Any]] = []
    if optimizer:
        for fqn, state in osd.get("state", {}).items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and _held(value):
                    flat[f"optim.{fqn}.{key}"] = value
        groups = [{k: v for k, v in g.items() if isinstance(v, (int, float, str, bool, list))
                   or v is None} for g in osd.get("param_groups", [])]
    return flat, groups


def _local_root(directory: str | os.PathLike[str]) -> Path:
    """The directory as a local path; a URL is refused (never a local folder named ``s3:``)."""
    if is_remote(directory):
        check_location(directory, "the sharded checkpoint location")
        raise StorageURLError(
            f"sharded (DCP) checkpoints are written to a file system every rank sees; "
            f"{os.fspath(directory)!r} is an object store URL, which they do not support yet. "
            "HINT: use a shared file system path (NFS, Lustre, a FUSE mount of the bucket), "
            "or a strategy that holds the whole model on each rank, whose backups go to URLs.")
    return local_path(directory)


class StagedShards:
    """This rank's sharded model and optimizer state copied at a step boundary (see
    :func:`stage_sharded`): what a background sharded save writes while training goes on."""

    def __init__(self, flat: dict[str, Any], groups: list[dict[str, Any]],
                 optimizers: bool) -> None:
        self.flat, self.groups, self.optimizers = flat, groups, optimizers

    @property
    def nbytes(self) -> int:
        return sum(_local(t).numel() * _local(t).element_size() for t in self.flat.values())


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _copy(t: Any) -> Any:
    """A CPU copy of ``t``; a DTensor keeps its mesh and placements around a copied shard."""
    if hasattr(t, "to_local"):
        from torch.distributed.tensor import DTensor

        local = t.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.detach().to("cpu", copy=True)


def stage_sharded(model: torch.nn.Module, optimizer: Optimizers = None) -> StagedShards:
    """Copy this rank's part of ``model`` (and ``optimizer``) now, for :func:`write_staged`."""
    optimizers = _as_list(optimizer)
    msd, osd = get_state_dict(model, optimizers)
    flat, groups = _flat_state(msd, osd, bool(optimizers))
    return StagedShards({k: _copy(v) for k, v in flat.items()}, groups, bool(optimizers))


def save_sharded(directory: str | os.PathLike[str], step: int, model: torch.nn.Module,
                 optimizer: Optimizers = None, *, collectives: Collectives | None = None,
                 keep: int = 2) -> Path:
    """Save ``model`` (and ``optimizer``, or a list of them) at ``step`` under ``directory``;
    every rank of ``collectives`` (default: the whole job) calls it.

    The optimizers must already hold the model's (sharded) parameters: under a strategy use
    :func:`replicator.resume.save_sharded`, which lets the strategy prepare them first.
    Returns the committed ``step-N`` directory. Raises :class:`CheckpointWriteError` on every
    rank when any rank fails, leaving the previous checkpoints as they were.
    """
    optimizers = _as_list(optimizer)
    ch = Channel(collectives if collectives is not None else group_collectives())
    root = _local_root(directory)
    try:
        msd, osd = get_state_dict(model, optimizers)
        flat, groups = _flat_state(msd, osd, bool(optimizers))
        staged: StagedShards | Exception = StagedShards(flat, groups, bool(optimizers))
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks in write_staged
        staged = exc
    return write_staged(root, step, staged, ch, keep=keep)


def write_staged(directory: str | os.PathLike[str], step: int,
                 staged: StagedShards | Exception, ch: Channel, *, keep: int = 2) -> Path:
    """Write and commit ``staged`` (from :func:`stage_sharded`) as ``step``; every rank of
    ``ch`` calls it (on a background thread, ``ch`` runs over a private group)."""
    root = _local_root(directory)
    attempt = resolve_cluster().restart_count
    tmp = root / f".tmp-{_step_dir(step)}-a{attempt}"
    final = root / _step_dir(step)
    error = ""
    try:
        if isinstance(staged, Exception):
            raise staged
        flat, groups = staged.flat, staged.groups
        if ch.is_chief:
            tmp.mkdir(parents=True, exist_ok=True)
        ch.all_gather("", f"checkpoint save of step {step} (directory)")
        dcp.save(flat, storage_writer=dcp.HuggingFaceStorageWriter(str(tmp),
                                                                   save_distributed=True),
                 process_group=ch.collectives.group, no_dist=ch.world_size == 1)
        if ch.is_chief and staged.optimizers:
            write_durable(tmp / GROUPS_FILE, json.dumps(groups).encode())
    except Exception as exc:  # noqa: BLE001 - shared with the other ranks below
        error = f"{type(exc).__name__}: {exc}"
    failures = ch.failures(error, f"checkpoint save of step {step} (writes)")
    if failures:
        if ch.is_chief:
            remove_tree(tmp)
        raise CheckpointWriteError(
            f"saving the sharded checkpoint of step {step} to {root} failed "
            f"({describe_failures(failures)}). Nothing was committed. HINT: check that every "
            f"rank can write to {root} and has space there.")
    commit_error = ""
    if ch.is_chief:
        try:
            files = {p.name: FileEntry(bytes=p.stat().st_size, sha256=hash_file(p))
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            manifest = build(step, ch.world_size, files, {"layout": "dcp-safetensors"})
            fsync_dir(tmp)
            if final.exists():
                remove_tree(final)
            os.rename(tmp, final)
            fsync_dir(root)
            write_marker(final, manifest)
            _prune(root, keep)
        except Exception as exc:  # noqa: BLE001 - reported to every rank below
            commit_error = f"{type(exc).__name__}: {exc}"
            remove_tree(tmp)
    outcome = ch.from_chief(commit_error, f"checkpoint save of step {step} (commit)")
    if outcome:
        raise CheckpointWriteError(f"committing the sharded checkpoint of step {step} in "
                                   f"{root} failed on the chief: {outcome}")
    return final


def _committed(root: Path) -> list[tuple[int, Path]]:
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    found = []
    for p in entries:
        if p.name.startswith(_STEP_PREFIX) and p.name[len(_STEP_PREFIX):].isdigit() and \
                (p / MARKER_NAME).exists():
            found.append((int(p.name[len(_STEP_PREFIX):]), p))
    return sorted(found)


def _prune(root: Path, keep: int) -> None:
    for _, p in _committed(root)[:-keep]:
        remove_tree(p, wait=False)


def load_sharded(directory: str | os.PathLike[str], model: torch.nn.Module,
                 optimizer: Optimizers = None, *, step: int | None = None,
                 collectives: Collectives | None = None) -> int | None:
    """Load the newest verified checkpoint (or ``step``) into ``model`` (and ``optimizer``),
    whatever the layout it was saved in and the one it loads into; every rank of
    ``collectives`` (default: the whole job) calls it.

    The optimizers must already hold the model's (sharded) parameters (see
    :func:`save_sharded`). Returns the step loaded, or ``None`` when ``directory`` holds no
    checkpoint. Damaged or partial checkpoints are skipped with a warning;
    :class:`CheckpointCorruptError` when checkpoints exist but none verifies.
    """
    optimizers = _as_list(optimizer)
    ch = Channel(collectives if collectives is not None else group_collectives())
    root = _local_root(directory)
    choice: dict[str, Any] = {"step": -1, "skipped": [], "error": ""}
    if ch.is_chief:
        candidates = [(s, p) for s, p in _committed(root) if step is None or s == step]
        for s, p in reversed(candidates):
            try:
                verify(p, read_marker(p))
                choice["step"] = s
                break
            except CheckpointCorruptError as exc:
                choice["skipped"].append(str(exc))
        if choice["step"] < 0 and (candidates or step is not None):
            choice["error"] = ("; ".join(choice["skipped"]) or
                               f"no committed checkpoint of step {step} in {root}")
    choice = ch.from_chief(choice, "sharded checkpoint restore (choice)")
    for text in choice["skipped"]:
        warnings.warn(f"skipping a damaged checkpoint: {text}", RuntimeWarning, stacklevel=2)
    if choice["error"]:
        raise CheckpointCorruptError(f"no valid sharded checkpoint to load in {root}: "
                                     f"{choice['error']}. HINT: delete the damaged step "
                                     "directories, or load an older step=.")
    if choice["step"] < 0:
        return None
    path = root / _step_dir(choice["step"])
    msd, osd = get_state_dict(model, optimizers)
    flat, _ = _flat_state(msd, osd, bool(optimizers))
    dcp.load(flat, storage_reader=dcp.HuggingFaceStorageReader(str(path)),  # in place, into
             process_group=ch.collectives.group,  # the state dicts' own tensors
             no_dist=ch.world_size == 1)
    if optimizers and (path / GROUPS_FILE).exists():
        groups = json.loads((path / GROUPS_FILE).read_text())
        targets: list[dict[str, Any]] = list(osd.get("param_groups", []))  # type: ignore[arg-type]
        for saved, group in zip(groups, targets):
            group.update({k: v for k, v in saved.items() if k != "params"})
    set_state_dict(model, optimizers, model_state_dict=msd, optim_state_dict=osd)
    return int(choice["step"])


def discard_uncommitted(directory: str | os.PathLike[str], after: int | None = None) -> None:
    """Remove interrupted saves (``.tmp-*``, ``.trash-*``) and, with ``after``, every step
    newer than ``after`` (a run resumed from ``after`` writes them again). The chief calls it
    while no save is running."""
    if is_remote(directory):
        return  # no sharded checkpoints are written to URLs
    root = Path(directory)
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return
    for p in entries:
        name = p.name
        newer = (after is not None and name.startswith(_STEP_PREFIX)
                 and name[len(_STEP_PREFIX):].isdigit() and int(name[len(_STEP_PREFIX):]) > after)
        if name.startswith((".tmp-", ".trash-")) or newer:
            remove_tree(p)
