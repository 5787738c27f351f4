"""What a worker runs: a chunk of elements through a map, or a whole batch (load, map,
collate). Both are module-level classes, so process workers started by spawn can receive them;
with ``on_error="skip"`` a failing element is left out and described for the stats."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from replicator.data.errors import InputPipelineError


def describe_element(element: Any) -> str:
    """A short name for an element in messages: a shard sample's key and shard, else its
    start."""
    if isinstance(element, dict) and "__key__" in element:
        url = element.get("__url__")
        return f"sample {element['__key__']!r}" + (f" of shard {url}" if url else "")
    text = repr(element)
    return f"element {text[:60]}{'...' if len(text) > 60 else ''}"


def _apply(fns: tuple[Callable[[Any], Any], ...], element: Any) -> Any:
    for fn in fns:
        element = fn(element)
    return element


class MapChunk:
    """Apply ``fns`` to each element of a chunk: ``(outputs, failures)``."""

    def __init__(self, fns: tuple[Callable[[Any], Any], ...], on_error: str) -> None:
        self.fns, self.on_error = fns, on_error

    def __call__(self, elements: list[Any]) -> tuple[list[Any], list[str]]:
        outputs, failures = [], []
        for element in elements:
            try:
                outputs.append(_apply(self.fns, element))
            except Exception as exc:
                if self.on_error != "skip":
                    raise InputPipelineError(
                        f"map failed on {describe_element(element)}: {type(exc).__name__}: "
                        f"{exc}. HINT: fix the data or the function, or pass "
                        "on_error='skip' to skip such samples (counted in stats())") from exc
                failures.append(f"{describe_element(element)}: {type(exc).__name__}: {exc}")
        return outputs, failures


class BatchWork:
    """Map and collate one batch: ``(batch, samples kept, failures)``."""

    def __init__(self, fns: tuple[Callable[[Any], Any], ...], on_error: str,
                 collate: Callable[[list[Any]], Any]) -> None:
        self.chunk = MapChunk(fns, on_error)
        self.collate = collate

    def load(self, elements: list[Any]) -> tuple[list[Any], list[str]]:
        samples, failures = self.chunk(elements) if self.chunk.fns else (list(elements), [])
        if not samples:
            raise InputPipelineError(
                f"every sample of a batch of {len(elements)} failed; the first: {failures[0]}")
        return samples, failures

    def __call__(self, elements: list[Any]) -> tuple[Any, int, list[str]]:
        samples, failures = self.load(elements)
        return self.collate(samples), len(samples), failures
