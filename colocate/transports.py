"""Transports that carry flattened buckets from the publisher to a receiver.

* ``inprocess``: the receiver lives in this process; the bucket is handed over by reference.
* ``shm``: CPU shared memory; the receiver is another process behind a :class:`RemoteReceiver`.
  Each staging buffer crosses the pipe once as a file-descriptor handle (ForkingPickler) and is
  then addressed by slot: writes are visible to the receiver with no copy.
* ``cuda_ipc``: the same over CUDA IPC (staging buffers on the GPU; one handle per buffer).
* ``disk``: each bucket written to a file atomically (temp + fsync + rename), loaded by path.

A transport is chosen by probing (:func:`choose_transport`): what the receiver reports in
``capabilities()`` intersected with what this process can do (CUDA present, receiver local).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers tensor reductions (shared memory, CUDA IPC)

from colocate.buckets import Entry, unpack_bucket

__all__ = ["TransportError", "ReceiverTimeout", "ReceiverDied", "RemoteError", "RemoteReceiver", "serve_receiver",
           "spawn_receiver", "choose_transport", "write_bucket_file", "read_bucket_file", "TRANSPORT_ORDER"]

TRANSPORT_ORDER = ("inprocess", "cuda_ipc", "shm", "disk")


class TransportError(RuntimeError):
    """Base of transport failures."""


class ReceiverTimeout(TransportError, TimeoutError):
    """The receiver did not answer within the timeout."""


class ReceiverDied(TransportError):
    """The receiver process exited (or its pipe closed) before answering."""


class RemoteError(TransportError):
    """The receiver raised; carries its exception type name and message."""

    def __init__(self, op: str, type_name: str, message: str):
        self.op, self.type_name, self.remote_message = op, type_name, message
        super().__init__(f"receiver failed in {op}: {type_name}: {message}")


def choose_transport(requested: str, receiver_caps: frozenset[str], *, local: bool) -> str:
    """The transport to use: ``requested`` if the receiver accepts it, else (for ``auto``) the
    first of :data:`TRANSPORT_ORDER` that both sides support."""
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
    """Write ``buffer[:nbytes]`` to ``path`` atomically (temp file, fsync, rename)."""
    data = buffer[:nbytes].cpu().numpy()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_bucket_file(path: str | Path, nbytes: int) -> torch.Tensor:
    """A uint8 tensor with the file's ``nbytes`` bytes."""
    size = os.path.getsize(path)
    if size != nbytes:
        raise TransportError(f"bucket file {path} has {size} bytes, expected {nbytes}")
    return torch.from_file(str(path), shared=False, size=nbytes, dtype=torch.uint8)


# ----- the receiver side of a cross-process transport -------------------------------------
def serve_receiver(conn: Any, receiver: Any) -> None:
    """Answer requests from a :class:`RemoteReceiver` until ``close`` or EOF.

    Requests are ``(seq, op, args)``; ``buffer``/``bucket`` ops address staging buffers by
    slot; every request gets ``(seq, "ok", result)`` or ``(seq, "err", type name, message)``.
    A receiver with ``load_views(views)`` (name → view of the slot's buffer) gets the views
    instead of ``load_bucket(entries, buffer)``; they are kept per slot while its entries and
    buffer stay (a replayed publish sends neither again), dropped with the slot.
    """
    slots: dict[Any, torch.Tensor] = {}
    entries_of: dict[Any, list[Entry]] = {}  # a slot's last entries (sent again as None when unchanged)
    views_of: dict[Any, dict[str, torch.Tensor]] = {}  # their views, for receivers with load_views
    while True:
        try:
            seq, op, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if op == "close":
                conn.send((seq, "ok", None))
                return
            if op == "buffer":
                slots[args[0]] = args[1]  # only views_of also holds it: "drop" must unmap it
                views_of.pop(args[0], None)
                result = None
            elif op == "drop_buffers":
                slots.clear()
                entries_of.clear()
                views_of.clear()
                result = None
            elif op == "drop":
                for key in args[0]:
                    slots.pop(key, None)
                    entries_of.pop(key, None)
                    views_of.pop(key, None)
                result = None
            elif op == "bucket":
                slot, entries = args
                if entries is None:  # the slot's entries again
                    entries = entries_of[slot]
                else:
                    entries_of[slot] = entries
                    views_of.pop(slot, None)
                if hasattr(receiver, "load_views"):  # the same entries again: views built once
                    views = views_of.get(slot)
                    if views is None:
                        views = views_of[slot] = unpack_bucket(slots[slot], entries)
                    receiver.load_views(views)
                else:
                    receiver.load_bucket(entries, slots[slot])
                result = None
            elif op == "file":
                entries, path, nbytes = args
                receiver.load_bucket(entries, read_bucket_file(path, nbytes))
                result = None
            else:
                result = getattr(receiver, op)(*args)
            conn.send((seq, "ok", result))
        except Exception as e:  # noqa: BLE001 - reported to the publisher with its type
            conn.send((seq, "err", type(e).__name__, str(e)))


def _receiver_main(conn: Any, factory: Callable[..., Any], args: tuple, ready_timeout: float) -> None:
    torch.set_num_threads(1)
    try:
        receiver = factory(*args)
    except Exception as e:  # noqa: BLE001
        conn.send((0, "err", type(e).__name__, str(e)))
        return
    conn.send((0, "ok", os.getpid()))
    serve_receiver(conn, receiver)


class RemoteReceiver:
    """Proxy to a receiver in another process (pipe + handles); every wait has a timeout.

    ``capabilities()`` drops ``inprocess``. Staging buffers are sent once per slot
    (:meth:`attach_buffer`); buckets then name their slot. A dead process raises
    :class:`ReceiverDied`, a silent one :class:`ReceiverTimeout`, a raising one
    :class:`RemoteError`. Requests carry sequence numbers, so a late answer to a request that
    timed out is recognised and dropped instead of being taken for the next answer.
    """

    def __init__(self, conn: Any, process: Any, *, timeout_s: float = 600.0):
        self.conn, self.process, self.timeout_s = conn, process, timeout_s
        self._attached: dict[int, int] = {}
        self._entries: dict[Any, list[Entry]] = {}  # the entries list each slot was last sent
        self._outstanding: list[tuple[int, str]] = []
        self._seq = 0

    @property
    def pid(self) -> int | None:
        return self.process.pid

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
        deadline = time.monotonic() + (timeout or self.timeout_s)
        while True:
            while not self.conn.poll(0.05):
                if not self.process.is_alive():
                    raise ReceiverDied(f"receiver pid {self.process.pid} died during {op} "
                                       f"(exit {self.process.exitcode})")
                if time.monotonic() > deadline:
                    raise ReceiverTimeout(f"receiver pid {self.process.pid} gave no answer to {op} "
                                          f"within {timeout or self.timeout_s:.1f}s")
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

    def capabilities(self) -> frozenset[str]:
        return frozenset(self._call("capabilities")) - {"inprocess"}

    def param_specs(self) -> dict:
        return self._call("param_specs")

    def begin_update(self, version: int) -> None:
        self._call("begin_update", version)

    def attach_buffer(self, slot: Any, buffer: torch.Tensor) -> bool:
        """Share ``buffer`` (shared-memory CPU or CUDA; a staging buffer or a whole storage viewed
        as bytes) with the receiver under ``slot`` (any picklable key); True when a new handle
        crossed (the first time this buffer fills this slot)."""
        key = (buffer.untyped_storage().data_ptr(), buffer.untyped_storage().nbytes())
        if self._attached.get(slot) == key:
            return False
        self._call("buffer", slot, buffer)
        self._attached[slot] = key
        return True

    def detach_buffers(self) -> None:
        """Make the receiver drop every shared staging buffer (so their memory can be freed)."""
        self._call("drop_buffers")
        self._attached.clear()
        self._entries.clear()

    def detach_slots(self, slots: list) -> None:
        """Make the receiver drop the buffers attached under ``slots`` (unmapping their storages)."""
        self._call("drop", list(slots))
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

    def load_file(self, entries: list[Entry], path: str, nbytes: int) -> None:
        self._call("file", entries, path, nbytes)

    def end_update(self, version: int, checksums: dict[str, int] | None) -> None:
        self._call("end_update", version, checksums)

    def abort_update(self, version: int) -> None:
        self._outstanding.clear()  # replies of a failed update are not awaited
        self._call("abort_update", version, timeout=min(self.timeout_s, 30.0))

    def weight_version(self) -> int | None:
        return self._call("weight_version")

    def rollback(self) -> None:
        self._call("rollback", timeout=min(self.timeout_s, 60.0))

    def checksums(self, names=None) -> dict[str, int]:
        return self._call("checksums", None if names is None else list(names))

    def sample(self, indices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._call("sample", indices)

    def call(self, op: str, *args: Any, timeout: float | None = None) -> Any:
        """Call any other method of the remote receiver (e.g. ``generate``, ``release_memory``)."""
        return self._call(op, *args, timeout=timeout)

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
    """Start ``factory(*args)`` (module-level, picklable) in a spawned child serving requests."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver_main, args=(child, factory, args, start_timeout_s), daemon=True)
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
