"""A small RPC layer for the control plane: ``multiprocessing.connection`` over a Unix socket.

Only metadata crosses it (dicts of ints/strings). The server exposes a fixed set of
:class:`~shared_teacher.source.SharedTeacherSource` methods; each connection gets a thread, so a
blocking call (``next_window``) of one reader never delays another. Errors come back as the
same typed exception. Every client call has a timeout: a dead server fails the call, never hangs it.
For several hosts the same protocol runs over TCP (``family="AF_INET"``); see docs.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from multiprocessing.connection import Client, Connection, Listener

from shared_teacher import errors as _errors

__all__ = ["SourceServer", "SourceClient", "METHODS"]

METHODS = frozenset({"subscribe", "plan", "admit", "publish", "heartbeat", "next_window", "ack_read", "ack_step",
                     "fail_student", "leave", "stats", "register_owned_pids", "requeue_unpublished"})
_ERRORS = {name: getattr(_errors, name) for name in _errors.__all__}
_ERRORS.update(TimeoutError=TimeoutError, ValueError=ValueError, KeyError=KeyError, TypeError=TypeError)


class SourceServer:
    """Serve ``source`` on a Unix socket; :attr:`connect_info` is what clients need (picklable)."""

    def __init__(self, source, *, address: str | None = None, authkey: bytes | None = None) -> None:
        self.source = source
        self._dir = None
        if address is None:
            self._dir = tempfile.mkdtemp(prefix="stsrc-")
            address = os.path.join(self._dir, "sock")
        self.address = address
        self.authkey = authkey or os.urandom(16)
        self._listener = Listener(address, family="AF_UNIX", authkey=self.authkey)
        self._conns: list[Connection] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="shared-teacher-rpc", daemon=True)
        self._thread.start()

    @property
    def connect_info(self) -> dict:
        return {"address": self.address, "authkey": self.authkey.hex()}

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError):
                if self._closed:
                    return
                continue  # a client that failed authentication
            if self._closed:
                conn.close()
                return
            self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        while True:
            try:
                method, kwargs = conn.recv()
            except (EOFError, OSError):
                return
            try:
                if method not in METHODS:
                    raise ValueError(f"unknown control-plane method {method!r}; known: {sorted(METHODS)}")
                reply = ("ok", getattr(self.source, method)(**kwargs))
            except BaseException as e:  # noqa: BLE001 - every failure goes back to the caller, typed
                extra = getattr(e, "fields", None) or getattr(e, "details", None)
                reply = ("err", type(e).__name__, str(e), extra)
            try:
                conn.send(reply)
            except (OSError, EOFError):
                return

    def close(self) -> None:
        self._closed = True
        try:
            with socket.socket(socket.AF_UNIX) as s:  # unblock accept()
                s.connect(self.address)
        except OSError:
            pass
        self._listener.close()
        for c in self._conns:
            c.close()
        self._thread.join(timeout=2)
        if self._dir:
            try:
                os.unlink(self.address)
                os.rmdir(self._dir)
            except OSError:
                pass


class SourceClient:
    """One connection to a :class:`SourceServer`; ``call(method, **kwargs)`` with a hard timeout."""

    def __init__(self, connect_info: dict, *, rpc_timeout: float = 120.0) -> None:
        self._conn = Client(connect_info["address"], family="AF_UNIX", authkey=bytes.fromhex(connect_info["authkey"]))
        self._lock = threading.Lock()
        self.rpc_timeout = rpc_timeout

    def call(self, method: str, **kwargs):
        """Call ``method``; waits at most ``kwargs['timeout'] + rpc_timeout`` for the reply."""
        limit = float(kwargs.get("timeout", 0)) + self.rpc_timeout
        with self._lock:
            self._conn.send((method, kwargs))
            if not self._conn.poll(limit):
                raise TimeoutError(f"control plane did not answer {method!r} within {limit:.1f}s")
            reply = self._conn.recv()
        if reply[0] == "ok":
            return reply[1]
        _, name, message, extra = reply
        cls = _ERRORS.get(name, _errors.SharedTeacherError)
        if cls in (_errors.IncompatibleSubscriptionError, _errors.AdmissionConfigError):
            raise cls(message, extra)
        raise cls(message if cls is not _errors.SharedTeacherError else f"{name}: {message}")

    def close(self) -> None:
        self._conn.close()
