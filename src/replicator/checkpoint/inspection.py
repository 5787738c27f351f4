"""``replicator checkpoints list|verify|export LOCATION``: look into backups without training,
local or in a store, read-only (never the lease, never a deletion)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from replicator.checkpoint import serialization
from replicator.checkpoint.storage import LocalStorage, open_storage
from replicator.checkpoint.store import DATA, RemoteStore, parse_commit_name
from replicator.errors import CheckpointCorruptError, CheckpointError

__all__ = ["Backup", "export_backup", "list_backups", "run",
           "verify_backups"]


@dataclass
class Backup:
    """One backup as ``list`` shows it."""

    step: int
    name: str
    created: float | None
    nbytes: int
    status: str
    manifest: dict[str, Any] | None = None


def _open(location: str | os.PathLike[str], storage_options: Mapping[str, Any] | None) -> Any:
    """The storage at ``location``, read-only; :class:`CheckpointError` for a missing folder."""
    storage = open_storage(location, storage_options, "the backup location")
    if isinstance(storage, LocalStorage) and not storage.directory.is_dir():
        raise CheckpointError(f"the backup location {storage.location} does not exist (or is "
                              "not a directory). HINT: check the path; a store's location "
                              "is a URL such as s3://bucket/run.")
    return storage


def _backups(storage: Any) -> list[Backup]:
    """Every save, committed (its manifest read, not verified), damaged or partial."""
    out, committed = [], set()
    for step, ref in storage.saves():
        try:
            manifest = storage.manifest(ref)
        except CheckpointCorruptError as exc:
            status = "partial (no commit)" if "no commit marker" in str(exc) \
                else f"damaged: {exc}"
            size = sum(p.stat().st_size for p in (storage.directory / ref).iterdir()
                       if p.is_file()) if isinstance(storage, LocalStorage) else 0
            out.append(Backup(step, ref, None, size, status))
            continue
        committed.add(str(manifest.get("prefix", ref)).split("/")[-1])
        size = sum(int(e["bytes"]) for e in manifest["files"].values())
        out.append(Backup(step, ref, manifest.get("created"), size, "committed", manifest))
    if isinstance(storage, RemoteStore):
        for folder in storage.folders(DATA):
            parsed = parse_commit_name(folder + ".json")
            if folder not in committed and parsed is not None:
                size = sum(n for _, n in storage.objects(f"{DATA}/{folder}"))
                out.append(Backup(parsed[0], folder, None, size, "partial (no commit)"))
    return sorted(out, key=lambda b: (b.step, b.created or 0.0))


def list_backups(location: str | os.PathLike[str],
                 storage_options: Mapping[str, Any] | None = None) -> list[Backup]:
    """Every backup at ``location``, oldest first, committed or not (nothing is verified)."""
    return _backups(_open(location, storage_options))


def verify_backups(location: str | os.PathLike[str], step: int | None = None,
                   storage_options: Mapping[str, Any] | None = None
                   ) -> list[tuple[Backup, str]]:
    """``(backup, "")`` for each committed backup whose every file verifies, else the reason
    (the object's name and the hash mismatch); only ``step`` when given."""
    storage = _open(location, storage_options)
    results = []
    for backup in _backups(storage):
        if step is not None and backup.step != step:
            continue
        if backup.manifest is None:
            results.append((backup, backup.status))
            continue
        try:
            for fname in sorted(backup.manifest["files"]):
                storage.read(backup.name, backup.manifest, fname)
            results.append((backup, ""))
        except CheckpointCorruptError as exc:
            results.append((backup, str(exc)))
    return results


def export_backup(location: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  step: int | None = None, state: str = "model",
                  storage_options: Mapping[str, Any] | None = None) -> Backup:
    """Write ``state`` of the newest backup that verifies (or of ``step``) to ``out``, a plain
    safetensors file (``safetensors.torch.load_file`` reads it); return the backup used."""
    storage = _open(location, storage_options)
    candidates = [b for b in _backups(storage) if b.manifest is not None
                  and (step is None or b.step == step)]
    reasons = []
    for backup in reversed(candidates):
        assert backup.manifest is not None
        fname = f"{state}.safetensors"
        if fname not in backup.manifest["files"]:
            sharded = backup.manifest.get("info", {}).get("sharded")
            held = sorted(n.removesuffix(".safetensors") for n in backup.manifest["files"]
                          if not n.startswith("rank-"))
            hint = (" (this backup holds the model sharded, under sharded/; load it with "
                    "rp.resume.load_sharded and save strategy.full_state_dict(model))"
                    if sharded else "")
            raise CheckpointError(f"backup {backup.name} holds no {state!r} state{hint}; it "
                                  f"holds: {', '.join(held) or 'none'}")
        try:
            data = storage.read(backup.name, backup.manifest, fname)
        except CheckpointCorruptError as exc:
            reasons.append(f"{backup.name}: {exc}")
            continue
        tree = serialization.decode(data, f"{backup.name}/{fname}")
        tensors = {k: v.contiguous() for k, v in serialization.leaves(tree)
                   if isinstance(v, torch.Tensor)}
        if not tensors:
            raise CheckpointError(f"backup {backup.name}: {state!r} holds no tensors")
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        serialization.write_file(Path(out), tensors, {"step": str(backup.step),
                                                 "source": f"{storage.location}/{backup.name}"})
        return backup
    which = f"step {step}" if step is not None else "backup"
    detail = "; ".join(reasons) if reasons else "none is committed"
    raise CheckpointCorruptError(f"no {which} at {storage.location} to export: {detail}")


# -- the command ----------------------------------------------------------------------------------
def _when(created: float | None) -> str:
    return "-" if created is None else \
        datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def run(args: argparse.Namespace) -> int:
    """Run ``replicator checkpoints ...``; the exit code (1: a backup failed to verify)."""
    try:
        if args.checkpoints_action == "list":
            backups = list_backups(args.location)
            if args.json:
                for b in backups:
                    print(json.dumps({"step": b.step, "name": b.name, "created": b.created,
                                      "bytes": b.nbytes, "status": b.status}))
                return 0
            if not backups:
                print(f"no backups at {args.location}")
                return 0
            print(f"{'step':>8}  {'time':19}  {'size':>9}  status  (name)")
            for b in backups:
                print(f"{b.step:>8}  {_when(b.created):19}  {_size(b.nbytes):>9}  {b.status}  "
                      f"({b.name})")
            return 0
        if args.checkpoints_action == "verify":
            results = verify_backups(args.location, args.step)
            if not results:
                print(f"no backups at {args.location}" + (f" of step {args.step}"
                                                          if args.step is not None else ""))
                return 1
            for b, reason in results:
                print(f"step {b.step:>8}  {'ok' if not reason else 'FAILED: ' + reason}  "
                      f"({b.name})")
            return 1 if any(reason for _, reason in results) else 0
        backup = export_backup(args.location, args.out, step=args.step, state=args.state)
        print(f"wrote {args.out}: {args.state} of step {backup.step} ({backup.name})")
        return 0
    except CheckpointError as exc:
        print(f"replicator checkpoints {args.checkpoints_action}: error: {exc}",
              file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"replicator checkpoints {args.checkpoints_action}: error: {exc}. HINT: check "
              "the location and, for a store, its credentials and endpoint.", file=sys.stderr)
        return 1
