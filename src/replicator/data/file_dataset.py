"""FileDataset: a list of files and a reader function, the input FILE sharding works on."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import IterableDataset

from replicator.data.errors import InputPipelineError

FileReader = Callable[[str], Iterable[Any]]


class FileDataset(IterableDataset):
    """The samples of ``files``, read one file after the other by ``reader(path)``.

    ``reader`` returns (or yields) the samples of one file. Under ``AutoShardPolicy.FILE``
    each replica reads only its own files; under ``DATA`` every replica reads them all.
    It is also a plain ``IterableDataset`` (iterating it reads every file in order).
    """

    def __init__(self, files: Sequence[str | os.PathLike[str]], reader: FileReader) -> None:
        if isinstance(files, (str, bytes, os.PathLike)):
            raise TypeError("FileDataset takes a list of files, got a single path. HINT: "
                            "write FileDataset([path], reader)")
        self.files = [os.fspath(f) for f in files]
        if not self.files:
            raise ValueError("FileDataset needs at least one file, got an empty list")
        if not callable(reader):
            raise TypeError(f"FileDataset needs a reader function reader(path) -> samples, got "
                            f"{type(reader).__name__}")
        self.reader = reader

    def read(self, path: str) -> Iterator[Any]:
        """The samples of one file, with the file named in any error."""
        try:
            yield from self.reader(path)
        except Exception as exc:
            name = getattr(self.reader, "__name__", "the reader")
            raise InputPipelineError(f"reading {path!r} with {name} failed: "
                                     f"{type(exc).__name__}: {exc}") from exc

    def __iter__(self) -> Iterator[Any]:
        for path in self.files:
            yield from self.read(path)

    @property
    def num_files(self) -> int:
        """How many files (the number of samples is known only by reading them)."""
        return len(self.files)

    def __repr__(self) -> str:
        name = getattr(self.reader, "__name__", "?")
        return f"FileDataset({len(self.files)} files, reader={name})"
