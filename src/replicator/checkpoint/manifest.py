"""The commit marker: a JSON manifest of a save's files with their size and SHA-256, written
last and checksummed itself; a save counts only when it and every file it lists check out.
Only safetensors and JSON files may be listed (a pickle makes the save refused)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replicator.checkpoint.atomic import read_and_hash, write_atomic
from replicator.errors import CheckpointCorruptError, UnsafeCheckpointError

MARKER_NAME = "COMMIT.json"
FORMAT = "replicator.checkpoint"
VERSION = 1
SAFE_SUFFIXES = (".safetensors", ".json")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,200}$")


@dataclass(frozen=True)
class FileEntry:
    """One file of a checkpoint: its size in bytes and SHA-256 (hex)."""

    bytes: int
    sha256: str


def check_file_name(name: str, where: str) -> None:
    """Refuse names that could escape the directory or hold a pickle."""
    if not _NAME.match(name) or ".." in name:
        raise CheckpointCorruptError(f"{where}: file name {name!r} is not allowed in a "
                                     "checkpoint (path separators or odd characters)")
    if not name.endswith(SAFE_SUFFIXES):
        raise UnsafeCheckpointError(
            f"{where} lists {name!r}, which is neither safetensors nor JSON: a checkpoint "
            "carrying a pickle payload is refused, and nothing in it is loaded. HINT: if you "
            "trust its origin, convert it with torch.load(path, weights_only=True) and "
            "safetensors; otherwise delete it.")


def _checksum(manifest: Mapping[str, Any]) -> str:
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


def seal(manifest: dict[str, Any]) -> bytes:
    """Set ``manifest``'s checksum (over every other field); return the marker's bytes."""
    manifest["checksum"] = _checksum(manifest)
    return json.dumps(manifest, indent=1, sort_keys=True, allow_nan=True).encode()


def build(step: int, world_size: int, files: Mapping[str, FileEntry],
          info: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest of a save at ``step`` holding ``files``; ``info`` is free JSON."""
    for name in files:
        check_file_name(name, f"checkpoint at step {step}")
    body = {"format": FORMAT, "version": VERSION, "step": int(step),
            "world_size": int(world_size), "created": time.time(),
            "files": {name: asdict(entry) for name, entry in sorted(files.items())},
            "info": dict(info)}
    seal(body)
    return body


def write_marker(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Commit ``step_dir``: write its manifest atomically; nothing may be written after it."""
    write_atomic(step_dir / MARKER_NAME, seal(manifest))


def read_marker(step_dir: Path) -> dict[str, Any]:
    """The manifest of ``step_dir``; :class:`CheckpointCorruptError` when missing or damaged."""
    path = step_dir / MARKER_NAME
    where = f"checkpoint {step_dir}"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if not step_dir.is_dir():
            raise CheckpointCorruptError(f"{where} does not exist") from None
        raise CheckpointCorruptError(f"{where} has no commit marker ({MARKER_NAME}): its save "
                                     "was interrupted before it completed") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"{where}: cannot read {MARKER_NAME}: {exc}") from exc
    return parse_marker(raw, where)


def parse_marker(raw: bytes, where: str) -> dict[str, Any]:
    """A manifest from its bytes; :class:`CheckpointCorruptError` when it does not check out."""
    try:
        manifest = json.loads(raw)
        ok = manifest.get("checksum") == _checksum(manifest)
    except (ValueError, AttributeError) as exc:
        raise CheckpointCorruptError(f"{where}: {MARKER_NAME} is not valid JSON ({exc})") from exc
    if not ok:
        raise CheckpointCorruptError(f"{where}: {MARKER_NAME} fails its own checksum (damaged)")
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointCorruptError(
            f"{where}: {MARKER_NAME} has format {manifest.get('format')!r} version "
            f"{manifest.get('version')!r}; this replicator reads {FORMAT!r} version {VERSION}")
    if not isinstance(manifest.get("files"), dict):
        raise CheckpointCorruptError(f"{where}: {MARKER_NAME} lists no files")
    for name in manifest["files"]:
        check_file_name(name, where)
    return manifest


def verify_file(step_dir: Path, manifest: Mapping[str, Any], name: str) -> np.ndarray:
    """Read ``name`` from ``step_dir`` and check it against the manifest; return its bytes."""
    where = f"checkpoint {step_dir}"
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointCorruptError(f"{where} does not list {name!r} in its manifest")
    check_file_name(name, where)
    try:
        data, digest = read_and_hash(step_dir / name)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where}: {name} is missing") from None
    except OSError as exc:
        raise CheckpointCorruptError(f"{where}: cannot read {name}: {exc}") from exc
    check_bytes(where, name, entry, len(data), digest)
    return data


def check_bytes(where: str, name: str, entry: Mapping[str, Any], size: int,
                digest: str) -> None:
    """Raise :class:`CheckpointCorruptError` when ``size``/``digest`` differ from ``entry``."""
    if size != entry.get("bytes"):
        raise CheckpointCorruptError(f"{where}: {name} has {size} bytes, the manifest "
                                     f"says {entry.get('bytes')} (truncated or replaced)")
    if digest != entry.get("sha256"):
        raise CheckpointCorruptError(
            f"{where}: {name} fails its SHA-256 check (its bytes changed after it was "
            f"written): sha256 {digest}, the manifest says {entry.get('sha256')}")

