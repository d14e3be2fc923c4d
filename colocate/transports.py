"""Transports that carry flattened buckets from the publisher to a receiver.

* ``inprocess``: the receiver lives in this process; the bucket is handed over by reference.
* ``shm``: CPU shared memory; the receiver is another process behind a :class:`RemoteReceiver`.
  Each staging buffer crosses the pipe once as a file-descriptor handle (ForkingPickler) and is
  then addressed by slot: writes are visible to the receiver with no copy.
* ``cuda_ipc``: the same over CUDA IPC (staging buffers on the GPU; one handle per buffer).
* ``disk``: each bucket written to a file atomically (temp + fsync + rename), loaded by path.

A transport is chosen by probing (:func:`choose_transport`): what the receiver reports in
``capabilities()`` intersected with what this process can do (CUDA present, receiver local).
The publisher reaches the receiver through a :class:`~colocate.protocol.ReceiverLink`:
:class:`RemoteReceiver` for a receiver in another process (:func:`spawn_receiver`),
:class:`LocalLink` for one in this process (:func:`link_to` picks).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor reductions (shared memory, CUDA IPC)

from colocate.buckets import Entry, unpack_bucket
from colocate.errors import ReceiverDied, ReceiverTimeout, RemoteError, TransportError
from colocate.protocol import ReceiverLink, WeightReceiver
from mcore_distill.atomic import atomic_write
from mcore_distill.lifetime import exit_with_parent

__all__ = ["TransportError", "ReceiverTimeout", "ReceiverDied", "RemoteError", "RemoteReceiver", "LocalLink",
           "link_to", "serve_receiver", "spawn_receiver", "choose_transport", "write_bucket_file", "read_bucket_file",
           "TRANSPORT_ORDER"]

TRANSPORT_ORDER = ("inprocess", "cuda_ipc", "shm", "disk")


def choose_transport(requested: str, receiver_caps: frozenset[str], *, local: bool = True) -> str:
    """The transport to use: ``requested`` if the receiver accepts it, else (for ``auto``) the
    first of :data:`TRANSPORT_ORDER` that both sides support. A :class:`RemoteReceiver` never
    reports ``inprocess``; ``local=False`` rules it out as well."""
    mine = {"shm", "disk"} | ({"inprocess"} if local else set())
    if torch.cuda.is_available():
        mine.add("cuda_ipc")
    usable = [t for t in TRANSPORT_ORDER if t in mine and t in receiver_caps]
    if requested == "auto":
        if not usable:
            raise TransportError(f"no common transport: receiver accepts {sorted(receiver_caps)}, "
                                 f"this process can use {sorted(mine)}")
        return usable[0]
    if requested not in usable:
        raise TransportError(f"transport {requested!r} not usable: receiver accepts {sorted(receiver_caps)}, "
                             f"this process can use {sorted(mine)}")
    return requested


def write_bucket_file(buffer: torch.Tensor, nbytes: int, path: Path) -> None:
    """Write ``buffer[:nbytes]`` to ``path`` atomically (:func:`mcore_distill.atomic.atomic_write`)."""
    data = buffer[:nbytes].cpu().numpy()
    with atomic_write(path) as f:
        f.write(memoryview(data))


def read_bucket_file(path: str | Path, nbytes: int) -> torch.Tensor:
    """A uint8 tensor with the file's ``nbytes`` bytes."""
    size = os.path.getsize(path)
    if size != nbytes:
        raise TransportError(f"bucket file {path} has {size} bytes, expected {nbytes}")
    return torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)


class LocalLink:
    """The publisher's link to a receiver in this process (see :class:`~colocate.protocol.ReceiverLink`):
    every hand-over is a direct call that returns once the receiver loaded it, no handle crosses,
    and ``timeout`` does not apply (the receiver's own timeouts do)."""

    def __init__(self, receiver: WeightReceiver):
        self.receiver = receiver

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        return getattr(self.receiver, op)(*args)

    def send(self, slot: Any, entries: list[Entry], buffer: torch.Tensor, nbytes: int, *, timeout: float) -> int:
        self.receiver.load_bucket(entries, buffer[:nbytes])
        return 0

    def send_file(self, entries: list[Entry], path: str, nbytes: int, *, timeout: float) -> None:
        self.receiver.load_bucket(entries, read_bucket_file(path, nbytes))

    def wait(self, *, below: int, timeout: float) -> None:
        pass  # every send returned after its load

    def abort(self, version: int, *, timeout: float) -> None:
        self.receiver.abort_update(version)

    def detach(self, slots: list | None = None, *, timeout: float) -> None:
        pass  # nothing was mapped


def link_to(receiver: WeightReceiver) -> ReceiverLink:
    """``receiver`` itself when it is a link (a :class:`RemoteReceiver`), else a :class:`LocalLink`."""
    return receiver if isinstance(receiver, ReceiverLink) else LocalLink(receiver)


# ----- the receiver side of a cross-process transport -------------------------------------
class _Slots:
    """The receiver process's view of what the publisher shared: buffers by slot, each slot's
    last entries (a replayed publish sends them again as None) and, for a receiver with
    ``load_views(views)``, their views (built once per entries and buffer)."""

    def __init__(self, receiver: Any):
        self.receiver = receiver
        self.buffers: dict[Any, torch.Tensor] = {}
        self.entries: dict[Any, list[Entry]] = {}
        self.views: dict[Any, dict[str, torch.Tensor]] = {}

    def buffer(self, slot: Any, buffer: torch.Tensor) -> None:
        self.buffers[slot] = buffer  # only self.views also holds it: "drop" must unmap it
        self.views.pop(slot, None)

    def drop(self, slots: list | None) -> None:
        for d in (self.buffers, self.entries, self.views):
            for key in list(d) if slots is None else slots:
                d.pop(key, None)

    def bucket(self, slot: Any, entries: list[Entry] | None) -> None:
        if entries is None:  # the slot's entries again
            entries = self.entries[slot]
        else:
            self.entries[slot] = entries
            self.views.pop(slot, None)
        if not hasattr(self.receiver, "load_views"):
            self.receiver.load_bucket(entries, self.buffers[slot])
            return
        views = self.views.get(slot)
        if views is None:
            views = self.views[slot] = unpack_bucket(self.buffers[slot], entries)
        self.receiver.load_views(views)

    def file(self, entries: list[Entry], path: str, nbytes: int) -> None:
        self.receiver.load_bucket(entries, read_bucket_file(path, nbytes))

    def handler(self, op: str) -> Callable[..., Any]:
        ops = {"buffer": self.buffer, "drop": self.drop, "drop_buffers": lambda: self.drop(None),
               "bucket": self.bucket, "file": self.file}
        return ops.get(op) or getattr(self.receiver, op)


def serve_receiver(conn: Any, receiver: Any) -> None:
    """Answer requests from a :class:`RemoteReceiver` until ``close`` or EOF.

    Requests are ``(seq, op, args)``; ``buffer``/``bucket``/``drop`` ops address shared buffers
    by slot, ``file`` loads a bucket file, any other op calls the receiver's method of that name.
    Every request gets ``(seq, "ok", result)`` or ``(seq, "err", type name, message)``. A
    receiver with ``load_views(views)`` (name → view of the slot's buffer) gets the views
    instead of ``load_bucket(entries, buffer)``; they are kept per slot while its entries and
    buffer stay (a replayed publish sends neither again), dropped with the slot.
    """
    slots = _Slots(receiver)
    while True:
        try:
            seq, op, args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":
            conn.send((seq, "ok", None))
            return
        try:
            conn.send((seq, "ok", slots.handler(op)(*args)))
        except Exception as e:  # noqa: BLE001 - reported to the publisher with its type
            conn.send((seq, "err", type(e).__name__, str(e)))


def _receiver_main(conn: Any, factory: Callable[..., Any], args: tuple, parent: int) -> None:
    exit_with_parent(parent)
    torch.set_num_threads(1)
    try:
        receiver = factory(*args)
    except Exception as e:  # noqa: BLE001
        conn.send((0, "err", type(e).__name__, str(e)))
        return
    conn.send((0, "ok", os.getpid()))
    serve_receiver(conn, receiver)


class RemoteReceiver:
    """Proxy to a receiver in another process (pipe + handles), and the publisher's
    :class:`~colocate.protocol.ReceiverLink` to it; every wait has a timeout.

    ``capabilities()`` drops ``inprocess``. Staging buffers are sent once per slot
    (:meth:`attach_buffer`); buckets then name their slot. A dead process raises
    :class:`ReceiverDied`, a silent one :class:`ReceiverTimeout`, a raising one
    :class:`RemoteError`. Requests carry sequence numbers, so a late answer to a request that
    timed out is recognised and dropped instead of being taken for the next answer; requests
    are served in order, so an ``abort_update`` sent after a timed-out ``end_update`` runs after
    it. ``timeout_s`` bounds calls made without a ``timeout`` (the publisher always passes its
    ``PublishConfig.timeout_s``).
    """

    def __init__(self, conn: Any, process: Any, *, timeout_s: float = 600.0):
        self.conn, self.process, self.timeout_s = conn, process, timeout_s
        self._attached: dict[Any, tuple[int, int]] = {}
        self._entries: dict[Any, list[Entry]] = {}  # the entries list each slot was last sent
        self._outstanding: list[tuple[int, str]] = []
        self._seq = 0

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.is_alive()

    def _call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        while self._outstanding:
            self.wait_one(timeout=timeout)
        seq = self._submit(op, *args)
        return self._reply(seq, op, timeout)

    def _submit(self, op: str, *args: Any) -> int:
        if not self.process.is_alive():
            raise ReceiverDied(f"receiver pid {self.process.pid} is dead (exit {self.process.exitcode}) before {op}")
        self._seq += 1
        try:
            self.conn.send((self._seq, op, args))
        except (BrokenPipeError, ConnectionResetError, EOFError) as e:
            raise ReceiverDied(f"receiver pid {self.process.pid}: pipe closed sending {op}") from e
        return self._seq

    def _reply(self, seq: int, op: str, timeout: float | None) -> Any:
        limit = timeout or self.timeout_s
        deadline = time.monotonic() + limit
        while True:
            while not self.conn.poll(0.05):
                if not self.process.is_alive():
                    raise ReceiverDied(f"receiver pid {self.process.pid} died during {op} "
                                       f"(exit {self.process.exitcode})")
                if time.monotonic() > deadline:
                    raise ReceiverTimeout(f"receiver pid {self.process.pid} gave no answer to {op} "
                                          f"within {limit:.1f}s")
            try:
                reply = self.conn.recv()
            except (EOFError, ConnectionResetError) as e:
                raise ReceiverDied(f"receiver pid {self.process.pid}: pipe closed during {op}") from e
            if reply[0] == seq:
                break
            # a late answer to an abandoned request: drop it
        if reply[1] == "err":
            raise RemoteError(op, reply[2], reply[3])
        return reply[2]

    # ----- the receiver's methods -------------------------------------------------------------
    def capabilities(self) -> frozenset[str]:
        return frozenset(self._call("capabilities")) - {"inprocess"}

    def param_specs(self) -> dict:
        return self._call("param_specs")

    def begin_update(self, version: int) -> None:
        self._call("begin_update", version)

    def load_bucket(self, entries: list[Entry], buffer: torch.Tensor) -> None:
        """Share ``buffer`` for this one load, wait for it, unmap it (a publisher streams through
        :meth:`send` instead, reusing slots)."""
        slot = ("load",)
        self.send(slot, entries, buffer, buffer.numel(), timeout=self.timeout_s)
        try:
            self.wait(below=1, timeout=self.timeout_s)
        finally:
            self.detach_slots([slot])

    def end_update(self, version: int, checksums: dict[str, int] | None) -> None:
        self._call("end_update", version, checksums)

    def abort_update(self, version: int) -> None:
        self.abort(version, timeout=min(self.timeout_s, 30.0))

    def weight_version(self) -> int | None:
        return self._call("weight_version")

    def rollback(self) -> None:
        self._call("rollback", timeout=min(self.timeout_s, 60.0))

    def checksums(self, names=None) -> dict[str, int]:
        return self._call("checksums", None if names is None else list(names))

    def sample(self, indices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._call("sample", indices)

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """Call any method of the remote receiver (e.g. ``generate``, ``release_memory``)."""
        return self._call(op, *args, timeout=timeout)

    # ----- shared buffers -------------------------------------------------------------------------
    @staticmethod
    def _key(buffer: torch.Tensor) -> tuple[int, int]:
        st = buffer.untyped_storage()
        return st.data_ptr(), st.nbytes()

    def attach_buffer(self, slot: Any, buffer: torch.Tensor, *, timeout: float | None = None) -> bool:
        """Share ``buffer`` (shared-memory CPU or CUDA; a staging buffer or a whole storage viewed
        as bytes) with the receiver under ``slot`` (any picklable key); True when a new handle
        crossed (the first time this buffer fills this slot)."""
        key = self._key(buffer)
        if self._attached.get(slot) == key:
            return False
        self._call("buffer", slot, buffer, timeout=timeout)
        self._attached[slot] = key
        return True

    def detach_buffers(self, *, timeout: float | None = None) -> None:
        """Make the receiver drop every shared buffer (so their memory can be freed)."""
        self._call("drop_buffers", timeout=timeout)
        self._attached.clear()
        self._entries.clear()

    def detach_slots(self, slots: list, *, timeout: float | None = None) -> None:
        """Make the receiver drop the buffers attached under ``slots`` (unmapping their storages)."""
        self._call("drop", list(slots), timeout=timeout)
        for k in slots:
            self._attached.pop(k, None)
            self._entries.pop(k, None)

    def submit_slot(self, slot: Any, entries: list[Entry]) -> None:
        """Ask the receiver to load ``entries`` from ``slot`` without waiting; acknowledgements
        come back in order through :meth:`wait_one`. The same list object sent again for a slot
        (a replayed publish) crosses as ``None``: the receiver reuses the entries it holds."""
        same = self._entries.get(slot) is entries
        self._entries[slot] = entries
        self._outstanding.append((self._submit("bucket", slot, None if same else entries), "bucket"))

    def wait_one(self, timeout: float | None = None) -> None:
        """Wait for the oldest outstanding acknowledgement."""
        seq, op = self._outstanding[0]
        try:
            self._reply(seq, op, timeout)
        finally:
            self._outstanding.pop(0)

    @property
    def in_flight(self) -> int:
        return len(self._outstanding)

    def load_file(self, entries: list[Entry], path: str, nbytes: int, *, timeout: float | None = None) -> None:
        self._call("file", entries, path, nbytes, timeout=timeout)

    # ----- the publisher's link (colocate.protocol.ReceiverLink) ----------------------------------
    def send(self, slot: Any, entries: list[Entry], buffer: torch.Tensor, nbytes: int, *, timeout: float) -> int:
        crossed = self.attach_buffer(slot, buffer, timeout=timeout)
        self.submit_slot(slot, entries)
        return int(crossed)

    def send_file(self, entries: list[Entry], path: str, nbytes: int, *, timeout: float) -> None:
        self.load_file(entries, path, nbytes, timeout=timeout)

    def wait(self, *, below: int, timeout: float) -> None:
        while len(self._outstanding) >= below:
            self.wait_one(timeout)

    def abort(self, version: int, *, timeout: float) -> None:
        self._outstanding.clear()  # replies of a failed update are not awaited
        self._call("abort_update", version, timeout=timeout)

    def detach(self, slots: list | None = None, *, timeout: float) -> None:
        if not self.process.is_alive():
            self._attached.clear()
            self._entries.clear()
        elif slots is None:
            self.detach_buffers(timeout=timeout)
        elif slots:
            self.detach_slots(slots, timeout=timeout)

    def close(self, *, timeout: float = 10.0) -> None:
        """Ask the receiver to exit; kill it if it does not within ``timeout``."""
        try:
            if self.process.is_alive():
                self._call("close", timeout=timeout)
        except TransportError:
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


def spawn_receiver(factory: Callable[..., Any], *args: Any, timeout_s: float = 600.0,
                   start_timeout_s: float = 120.0) -> RemoteReceiver:
    """Start ``factory(*args)`` (module-level, picklable) in a spawned child serving requests.
    The child exits when this process does (also when it is killed while the child is busy)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, factory, args, os.getpid()), daemon=True)
    proc.start()
    child.close()
    deadline = time.monotonic() + start_timeout_s
    while not parent.poll(0.1):
        if not proc.is_alive():
            raise ReceiverDied(f"receiver process exited during start (exit {proc.exitcode})")
        if time.monotonic() > deadline:
            proc.kill()
            raise ReceiverTimeout(f"receiver did not start within {start_timeout_s:.0f}s")
    reply = parent.recv()
    if reply[1] == "err":
        proc.join(5)
        raise RemoteError("start", reply[2], reply[3])
    return RemoteReceiver(parent, proc, timeout_s=timeout_s)
