"""Sharded safetensors checkpoints: the index, slice reads, bounded shard writes.

* :func:`open_checkpoint` reads ``model.safetensors.index.json`` (or a single
  ``model.safetensors``) and every shard's header: names, shapes and dtypes of all tensors
  without reading their data. A truncated or corrupt file fails here (safetensors checks that the
  header's offsets cover the file), naming the file.
* :class:`SliceReader` hands out ``safe_open(...).get_slice(name)`` handles, so a rank reads only
  the rows/columns it holds; it keeps few files open (the mapped pages of a closed file leave the
  process), so host memory stays bounded by one shard file plus the tensors being assembled.
* :class:`ShardWriter` collects host tensors and writes a file whenever the next tensor would
  push it past ``max_shard_bytes``: at most one shard of tensors is held at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mcore_distill.hf.errors import CheckpointFileError

__all__ = ["INDEX_NAME", "SINGLE_NAME", "TensorInfo", "CheckpointIndex", "open_checkpoint", "SliceReader",
           "ShardWriter"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: str
    """safetensors dtype name (``F32``, ``BF16``, …)."""


@dataclass
class CheckpointIndex:
    """All tensors of a checkpoint folder with their file, shape and dtype."""

    folder: Path
    tensors: dict[str, TensorInfo] = field(default_factory=dict)

    @property
    def files(self) -> list[str]:
        return sorted({t.file for t in self.tensors.values()})

    def meta(self, name: str) -> torch.Tensor:
        """A ``meta`` tensor of ``name``'s shape (for checking layouts without reading data)."""
        return torch.empty(self.tensors[name].shape, device="meta")


def _safe_open(path: Path):
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: safetensors file not found") from None
    except Exception as err:  # noqa: BLE001 - SafetensorError is not importable by a stable name
        raise CheckpointFileError(f"{path}: unreadable safetensors file (truncated or corrupt?): {err}") from None


def open_checkpoint(folder: str | Path) -> CheckpointIndex:
    """Index every tensor of the checkpoint in ``folder`` from the shard headers (no data read)."""
    folder = Path(folder)
    index_file = folder / INDEX_NAME
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointFileError(f"{index_file}: not a safetensors index ({err})") from None
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_NAME).is_file():
        weight_map, files = None, [SINGLE_NAME]
    else:
        raise CheckpointFileError(f"{folder}: neither {INDEX_NAME} nor {SINGLE_NAME}")
    out = CheckpointIndex(folder)
    for fname in files:
        if Path(fname).name != fname:
            raise CheckpointFileError(f"{index_file}: shard name {fname!r} is not a plain file name")
        with _safe_open(folder / fname) as f:
            for name in f.keys():
                if weight_map is not None and weight_map.get(name) != fname:
                    continue  # the index decides which copy counts
                s = f.get_slice(name)
                out.tensors[name] = TensorInfo(fname, tuple(s.get_shape()), s.get_dtype())
    if weight_map is not None:
        lost = sorted(n for n in weight_map if n not in out.tensors)
        if lost:
            raise CheckpointFileError(f"{index_file}: {len(lost)} tensors listed but absent from their files, "
                                      f"e.g. {lost[:5]}")
    return out


class SliceReader:
    """Lazily opened shard files; :meth:`source` returns a slicing handle for one tensor."""

    def __init__(self, index: CheckpointIndex):
        self.index = index
        self._open: dict[str, Any] = {}
        self.bytes_read = 0

    def source(self, name: str):
        info = self.index.tensors[name]
        f = self._open.get(info.file)
        if f is None:
            f = self._open[info.file] = _safe_open(self.index.folder / info.file).__enter__()
        return _Counting(f.get_slice(name), self)

    def keep_only(self, files: set[str]) -> None:
        """Close every open file not in ``files`` (unmaps its pages)."""
        for fname in [f for f in self._open if f not in files]:
            self._open.pop(fname).__exit__(None, None, None)

    def close(self) -> None:
        self.keep_only(set())


class _Counting:
    """A safetensors slice that counts the bytes it returns."""

    def __init__(self, s: Any, reader: SliceReader):
        self._s, self._reader = s, reader

    def get_shape(self):
        return self._s.get_shape()

    def __getitem__(self, item) -> torch.Tensor:
        t = self._s[item]
        self._reader.bytes_read += t.numel() * t.element_size()
        return t


class ShardWriter:
    """Collect host tensors; write ``<prefix>-<k>.safetensors`` files of at most
    ``max_shard_bytes`` (a larger single tensor gets a file of its own)."""

    def __init__(self, folder: str | Path, prefix: str, max_shard_bytes: int):
        self.folder, self.prefix, self.max_shard_bytes = Path(folder), prefix, max_shard_bytes
        self.files: list[tuple[str, list[str], int]] = []
        """``(file name, tensor names, bytes)`` of every file written."""
        self._pending: dict[str, torch.Tensor] = {}
        self._bytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self._pending and self._bytes + n > self.max_shard_bytes:
            self.flush()
        self._pending[name] = t
        self._bytes += n

    def flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file

        fname = f"{self.prefix}-{len(self.files):05d}.safetensors"
        save_file(self._pending, str(self.folder / fname), metadata={"format": "pt"})
        self.files.append((fname, list(self._pending), self._bytes))
        self._pending, self._bytes = {}, 0
