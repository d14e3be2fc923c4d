"""Feature stores: where sample objects live. The control plane only ever sees :class:`SampleRef`.

Protocol (:class:`FeatureStore`): ``put`` (write one sample object, visible atomically),
``get`` (read it into fresh tensors), ``release`` (free it; stale generations are no-ops),
``abort`` (drop a put that will never be published), ``gc`` (drop everything not in a live set).
A store is reopened in another process from :meth:`FeatureStore.spec` via :func:`open_store`, so
a store that moves bytes over RDMA (Mooncake, NIXL) fits the same five calls: ``put`` registers
a node-local buffer and returns its ref, ``get`` is a remote read into a local buffer.

Backends here, both one object per file ``<root>/<node>/<sample_id>.g<generation>``:

* :class:`ShmStore` — POSIX shared memory (``/dev/shm``): no disk I/O, visible to every
  process of the host.
* :class:`FileStore` — a local folder.

Both ``put`` through :func:`mcore_distill.atomic.atomic_write` (temp sibling + fsync + rename +
fsync of the folder; fsync is a no-op on tmpfs), so an object is visible complete or not at all,
and a killed writer leaves only a ``.<name>.tmp-<token>`` file that ``abort``/``gc`` remove.

Object layout: ``b"STSOBJ01"``, u64 header length, JSON header (name, dtype, shape, offset),
payload aligned to 64 bytes.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from mcore_distill.atomic import atomic_write
from shared_teacher.errors import StaleRefError, StoreError
from shared_teacher.refs import SampleRef

__all__ = ["FeatureStore", "ShmStore", "FileStore", "open_store", "encode_object", "decode_object"]

_MAGIC = b"STSOBJ01"
_ALIGN = 64
_DTYPES = {str(d): d for d in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64,
                               torch.int32, torch.int16, torch.uint8, torch.bool)}


def encode_object(tensors: dict[str, torch.Tensor]) -> tuple[bytes, list[memoryview]]:
    """Header bytes and payload views of ``tensors`` (CPU, contiguous) in the object layout."""
    entries, views, offset = [], [], 0
    for name, t in tensors.items():
        if str(t.dtype) not in _DTYPES:
            raise StoreError(f"feature {name!r}: dtype {t.dtype} is not storable; use one of {sorted(_DTYPES)}")
        t = t.detach().to("cpu").contiguous()
        nbytes = t.numel() * t.element_size()
        entries.append({"name": name, "dtype": str(t.dtype), "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
        views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()) if nbytes else memoryview(b""))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    header = json.dumps({"tensors": entries}).encode()
    return _MAGIC + struct.pack("<Q", len(header)) + header, views


def _payload_start(header_len: int) -> int:
    return (len(_MAGIC) + 8 + header_len + _ALIGN - 1) // _ALIGN * _ALIGN


def decode_object(buf: bytearray | bytes, *, where: str = "object") -> dict[str, torch.Tensor]:
    """Tensors of an encoded object; the tensors share memory with ``buf`` (a private copy)."""
    if bytes(buf[:8]) != _MAGIC:
        raise StoreError(f"{where}: bad magic {bytes(buf[:8])!r}, not a shared_teacher object")
    if len(buf) < 16:
        raise StoreError(f"{where}: truncated header ({len(buf)} bytes)")
    (hlen,) = struct.unpack("<Q", bytes(buf[8:16]))
    base = _payload_start(hlen)
    raw = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    out = {}
    try:
        header = json.loads(bytes(buf[16:16 + hlen]))
        for e in header["tensors"]:
            start = base + e["offset"]
            if start + e["nbytes"] > len(buf):
                raise StoreError(f"{where}: truncated tensor {e['name']!r} ({start + e['nbytes']} > {len(buf)} bytes)")
            out[e["name"]] = raw[start:start + e["nbytes"]].view(_DTYPES[e["dtype"]]).reshape(e["shape"])
    except (ValueError, KeyError, TypeError, RuntimeError) as err:  # a garbled header (JSON, fields, sizes)
        raise StoreError(f"{where}: corrupt object header: {type(err).__name__}: {err}") from None
    return out


@runtime_checkable
class FeatureStore(Protocol):
    """Storage of sample objects behind :class:`SampleRef` (see module docstring)."""

    def put(self, tensors: dict[str, torch.Tensor], *, sample_id: str, generation: int, node: str,
            num_tokens: int, schema_key: str, epoch: int, position: int) -> SampleRef: ...

    def get(self, ref: SampleRef) -> dict[str, torch.Tensor]: ...

    def release(self, ref: SampleRef) -> None: ...

    def abort(self, *, sample_id: str, generation: int, node: str) -> None: ...

    def gc(self, live: set[tuple[str, int]]) -> int: ...

    def pool_bytes(self, node: str) -> int: ...

    def spec(self) -> dict: ...

    def close(self, *, remove: bool = False) -> None: ...


class _DirStore:
    """One file per object under ``root/<node>/``."""

    kind = "dir"

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, node: str, sample_id: str, generation: int) -> Path:
        return self.root / node / f"{sample_id}.g{generation}"

    def put(self, tensors, *, sample_id, generation, node, num_tokens, schema_key, epoch, position) -> SampleRef:
        header, views = encode_object(tensors)
        final = self._path(node, sample_id, generation)
        final.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(final, "wb") as f:  # temp sibling + fsync + rename + fsync of the folder
            f.write(header)
            f.write(b"\0" * (_payload_start(len(header) - 16) - len(header)))
            for v in views:
                f.write(v)
                pad = (-len(v)) % _ALIGN
                if pad:
                    f.write(b"\0" * pad)
            nbytes = f.tell()
        return SampleRef(sample_id=sample_id, generation=generation, node=node, nbytes=nbytes,
                         num_tokens=num_tokens, schema_key=schema_key, epoch=epoch, position=position)

    def get(self, ref: SampleRef) -> dict[str, torch.Tensor]:
        path = self._path(ref.node, ref.sample_id, ref.generation)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                buf = bytearray(size)
                got = f.readinto(buf)
        except FileNotFoundError:
            raise StaleRefError(
                f"sample {ref.sample_id} generation {ref.generation} on node {ref.node!r} is not in the store "
                f"(released, aborted or never committed)") from None
        if got != size:
            raise StoreError(f"{path}: short read {got} of {size} bytes")
        return decode_object(buf, where=str(path))

    def release(self, ref: SampleRef) -> None:
        try:
            self._path(ref.node, ref.sample_id, ref.generation).unlink()
        except FileNotFoundError:
            pass  # stale or double release: a no-op by contract

    def abort(self, *, sample_id: str, generation: int, node: str) -> None:
        final = self._path(node, sample_id, generation)
        for p in [final, *final.parent.glob(f".{final.name}.tmp-*")] if final.parent.exists() else []:
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    def gc(self, live: set[tuple[str, int]]) -> int:
        """Remove every object (and leftover temp file) whose (sample_id, generation) is not live."""
        removed = 0
        for p in self.root.glob("*/*"):
            name = p.name
            if name.startswith("."):
                p.unlink(missing_ok=True)
                removed += 1
                continue
            sid, _, gen = name.rpartition(".g")
            if (sid, int(gen)) not in live:
                p.unlink(missing_ok=True)
                removed += 1
        return removed

    def pool_bytes(self, node: str) -> int:
        """Bytes of the node's files now; a file renamed or removed while we scan counts as gone."""
        d = self.root / node
        total = 0
        for p in (d.iterdir() if d.exists() else ()):
            try:
                total += p.stat().st_size
            except FileNotFoundError:  # a writer's temp file was just renamed, or a release unlinked it
                pass
        return total

    def objects(self) -> list[tuple[str, str, int]]:
        """(node, sample_id, generation) of every committed object (for tests and leak checks)."""
        out = []
        for p in sorted(self.root.glob("*/*")):
            if not p.name.startswith("."):
                sid, _, gen = p.name.rpartition(".g")
                out.append((p.parent.name, sid, int(gen)))
        return out

    def spec(self) -> dict:
        return {"kind": self.kind, "root": str(self.root)}

    def close(self, *, remove: bool = False) -> None:
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


class ShmStore(_DirStore):
    """Objects in POSIX shared memory on this host (``/dev/shm/<name>``)."""

    kind = "shm"

    def __init__(self, name: str | None = None, *, root: str | None = None) -> None:
        if root is None:
            base = Path("/dev/shm")
            if not base.is_dir():
                raise StoreError("ShmStore needs /dev/shm (POSIX shared memory); use FileStore on this host")
            root = str(base / (name or f"shared_teacher-{uuid.uuid4().hex[:12]}"))
        super().__init__(root)


class FileStore(_DirStore):
    """Objects in a local folder, each written temp + fsync + rename (survives a crash of the writer)."""

    kind = "file"


def open_store(spec: dict) -> FeatureStore:
    """Reopen a store in another process from :meth:`FeatureStore.spec`."""
    kind = spec.get("kind")
    if kind == "shm":
        return ShmStore(root=spec["root"])
    if kind == "file":
        return FileStore(spec["root"])
    raise StoreError(f"open_store: unknown store kind {kind!r} (known: 'shm', 'file')")
