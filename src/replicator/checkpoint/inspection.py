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


class _Reader:
    """Read-only access to the backups of a local directory or a store."""

    def __init__(self, location: str | os.PathLike[str],
                 storage_options: Mapping[str, Any] | None = None) -> None:
        self.storage = open_storage(location, storage_options, "the backup location")
        self.label = str(self.storage.location)
        if isinstance(self.storage, LocalStorage) and not self.storage.directory.is_dir():
            raise CheckpointError(f"the backup location {self.label} does not exist (or is "
                                  "not a directory). HINT: check the path; a store's location "
                                  "is a URL such as s3://bucket/run.")

    def backups(self) -> list[Backup]:
        """Every save, committed (its manifest read, not verified), damaged or partial."""
        out, committed = [], set()
        for step, ref in self.storage.saves():
            try:
                manifest = self.storage.manifest(ref)
            except CheckpointCorruptError as exc:
                status = "partial (no commit)" if "no commit marker" in str(exc) \
                    else f"damaged: {exc}"
                out.append(Backup(step, ref, None, self._size(ref), status))
                continue
            committed.add(str(manifest.get("prefix", ref)).split("/")[-1])
            size = sum(int(e["bytes"]) for e in manifest["files"].values())
            out.append(Backup(step, ref, manifest.get("created"), size, "committed", manifest))
        if isinstance(self.storage, RemoteStore):
            for folder in self.storage.folders(DATA):
                parsed = parse_commit_name(folder + ".json")
                if folder not in committed and parsed is not None:
                    size = sum(n for _, n in self.storage.objects(f"{DATA}/{folder}"))
                    out.append(Backup(parsed[0], folder, None, size, "partial (no commit)"))
        return sorted(out, key=lambda b: (b.step, b.created or 0.0))

    def _size(self, ref: str) -> int:
        if isinstance(self.storage, LocalStorage):
            return sum(p.stat().st_size for p in (self.storage.directory / ref).iterdir()
                       if p.is_file())
        return 0

    def read(self, backup: Backup, fname: str) -> Any:
        """The verified bytes of ``fname`` of ``backup`` (:class:`CheckpointCorruptError`)."""
        assert backup.manifest is not None
        return self.storage.read(backup.name, backup.manifest, fname)


def list_backups(location: str | os.PathLike[str],
                 storage_options: Mapping[str, Any] | None = None) -> list[Backup]:
    """Every backup at ``location``, oldest first, committed or not (nothing is verified)."""
    return _Reader(location, storage_options).backups()


def verify_backups(location: str | os.PathLike[str], step: int | None = None,
                   storage_options: Mapping[str, Any] | None = None
                   ) -> list[tuple[Backup, str]]:
    """``(backup, "")`` for each committed backup whose every file verifies, else the reason
    (the object's name and the hash mismatch); only ``step`` when given."""
    reader = _Reader(location, storage_options)
    results = []
    for backup in reader.backups():
        if step is not None and backup.step != step:
            continue
        if backup.manifest is None:
            results.append((backup, backup.status))
            continue
        try:
            for fname in sorted(backup.manifest["files"]):
                reader.read(backup, fname)
            results.append((backup, ""))
        except CheckpointCorruptError as exc:
            results.append((backup, str(exc)))
    return results


def export_backup(location: str | os.PathLike[str], out: str | os.PathLike[str], *,
                  step: int | None = None, state: str = "model",
                  storage_options: Mapping[str, Any] | None = None) -> Backup:
    """Write ``state`` of the newest backup that verifies (or of ``step``) to ``out``, a plain
    safetensors file (``safetensors.torch.load_file`` reads it); return the backup used."""
    reader = _Reader(location, storage_options)
    candidates = [b for b in reader.backups() if b.manifest is not None
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
            data = reader.read(backup, fname)
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
                                                 "source": f"{reader.label}/{backup.name}"})
        return backup
    which = f"step {step}" if step is not None else "backup"
    detail = "; ".join(reasons) if reasons else "none is committed"
    raise CheckpointCorruptError(f"no {which} at {reader.label} to export: {detail}")


# -- the command ----------------------------------------------------------------------------------
def _when(created: float | None) -> str:
    if created is None:
        return "-"
    return datetime.datetime.fromtimestamp(created).strftime("%Y-%m-%d %H:%M:%S")


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


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
            bad = 0
            for b, reason in results:
                print(f"step {b.step:>8}  {'ok' if not reason else 'FAILED: ' + reason}  "
                      f"({b.name})")
                bad += bool(reason)
            return 1 if bad else 0
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
