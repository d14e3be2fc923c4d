"""A small RPC layer for the control plane: ``multiprocessing.connection`` over a Unix socket.

Only metadata crosses it (dicts of ints/strings). The server exposes a fixed set of
:class:`~shared_teacher.source.SharedTeacherSource` methods; each connection gets a thread, so a
blocking call (``next_window``) of one reader never delays another. Errors come back as the
same typed exception. Every client call has a timeout: a dead server fails the call, never hangs it.
Pass ``address=(host, port)`` to serve over TCP for readers on other hosts.
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
    """Serve ``source``; :attr:`connect_info` is what clients need (picklable).

    ``address``: a Unix socket path (default: a fresh temp path), or ``(host, port)`` for TCP so
    readers on other hosts can connect (port 0 picks a free one). The authkey (random by
    default) authenticates every connection with HMAC; it does not encrypt.
    """

    def __init__(self, source, *, address: str | tuple[str, int] | None = None, authkey: bytes | None = None) -> None:
        self.source = source
        self._dir = None
        if address is None:
            self._dir = tempfile.mkdtemp(prefix="stsrc-")
            address = os.path.join(self._dir, "sock")
        self.family = "AF_INET" if isinstance(address, tuple) else "AF_UNIX"
        self.authkey = authkey or os.urandom(16)
        # a deep backlog: with the default of 1, concurrent TCP connects get SYN-dropped and back off for seconds
        self._listener = Listener(address, family=self.family, authkey=self.authkey, backlog=128)
        self.address = self._listener.address
        self._conns: list[Connection] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="shared-teacher-rpc", daemon=True)
        self._thread.start()

    @property
    def connect_info(self) -> dict:
        return {"address": self.address, "family": self.family, "authkey": self.authkey.hex()}

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
            except (EOFError, OSError, TypeError):  # TypeError: closed under us by close()
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
            with socket.socket(socket.AF_INET if self.family == "AF_INET" else socket.AF_UNIX) as s:
                s.settimeout(1.0)
                s.connect(self.address)  # unblock accept()
        except OSError:
            pass
        self._listener.close()
        for c in self._conns:
            c.close()
        self._thread.join(timeout=2)
        if self._dir and self.family == "AF_UNIX":
            try:
                os.unlink(self.address)
                os.rmdir(self._dir)
            except OSError:
                pass


class SourceClient:
    """One connection to a :class:`SourceServer`; ``call(method, **kwargs)`` with a hard timeout."""

    def __init__(self, connect_info: dict, *, rpc_timeout: float = 120.0) -> None:
        family = connect_info.get("family", "AF_UNIX")
        address = tuple(connect_info["address"]) if family == "AF_INET" else connect_info["address"]
        self._conn = Client(address, family=family, authkey=bytes.fromhex(connect_info["authkey"]))
        self._lock = threading.Lock()
        self.rpc_timeout = rpc_timeout

    def call(self, method: str, **kwargs):
        """Call ``method``; waits at most ``kwargs['timeout'] + rpc_timeout`` for the reply.

        Raises the source's typed error (``TimeoutError`` when a blocking method's own wait expired),
        or ``ConnectionError`` when the control plane did not answer at all.
        """
        limit = float(kwargs.get("timeout", 0)) + self.rpc_timeout
        with self._lock:
            self._conn.send((method, kwargs))
            if not self._conn.poll(limit):  # not a TimeoutError: that one means "the source waited, nothing came"
                raise ConnectionError(f"control plane did not answer {method!r} within {limit:.1f}s")
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
