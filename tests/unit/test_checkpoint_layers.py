"""The checkpoint room is storage only: it imports no higher room (inside functions included),
never reaches for a strategy by lookup, and the resume room above it asks a strategy only
through its public API. Checked on the source with ``ast``, so a lazy import cannot hide."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import replicator

PACKAGE = Path(replicator.__file__).parent
CHECKPOINT = PACKAGE / "checkpoint"
#: The rooms the checkpoint room may import: itself and the ones below it.
LOWER = {"checkpoint", "cluster", "comm", "data", "optim", "errors", "fault_points",
         "lazy_names"}


def _files(room: Path) -> list[Path]:
    files = sorted(room.rglob("*.py"))
    assert files, f"no sources under {room}"
    return files


def _imported(path: Path, tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``tree``, relative ones resolved."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "replicator":  # from replicator import <room or module>
                found += [(node.lineno, f"replicator.{a.name}") for a in node.names]
            else:
                found.append((node.lineno, module))
    return found


@pytest.mark.parametrize("path", _files(CHECKPOINT), ids=lambda p: p.name)
def test_checkpoint_imports_no_higher_room(path):
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for line, module in _imported(path, tree):
        parts = module.split(".")
        if parts[0] != "replicator":
            continue
        if len(parts) == 1 or parts[1] not in LOWER:
            bad.append(f"{path.name}:{line} imports {module}")
    assert not bad, "the checkpoint room imports a higher room: " + "; ".join(bad)


@pytest.mark.parametrize("path", _files(CHECKPOINT), ids=lambda p: p.name)
def test_checkpoint_never_looks_a_strategy_up(path):
    """No ``sys.modules`` or ``importlib`` back door, no ``strategy`` parameter, no
    ``getattr`` of ``shards_model``, ``collectives`` or a private strategy method."""
    tree = ast.parse(path.read_text(), str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "modules" and isinstance(
                node.value, ast.Name) and node.value.id == "sys":
            bad.append(f"{path.name}:{node.lineno} reads sys.modules")
        if isinstance(node, ast.Name) and node.id in ("importlib", "__import__"):
            bad.append(f"{path.name}:{node.lineno} imports by name")
        if isinstance(node, ast.arg) and node.arg == "strategy":
            bad.append(f"{path.name}:{node.lineno} takes a strategy")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in (
                    "shards_model", "collectives", "prepare_optimizers", "_remap_optimizer"):
            bad.append(f"{path.name}:{node.lineno} asks an object for {node.args[1].value}")
    assert not bad, "the checkpoint room reaches for a strategy: " + "; ".join(bad)


def test_checkpoint_exports_storage_names_only():
    import replicator.checkpoint as checkpoint

    loop = {"BackupAndRestore", "Preempted", "PreemptionWatcher", "PREEMPTION_EXIT_CODE",
            "NonFiniteGuard"}
    assert not loop & set(checkpoint.__all__)
    assert not any(hasattr(checkpoint, name) for name in loop)


def test_resume_asks_a_strategy_through_public_names_only():
    """``strategy._anything`` never appears in the resume room."""
    bad = []
    for path in _files(PACKAGE / "resume"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and isinstance(
                    node.value, ast.Name) and node.value.id == "strategy":
                bad.append(f"{path.name}:{node.lineno} uses strategy.{node.attr}")
    assert not bad, "; ".join(bad)
