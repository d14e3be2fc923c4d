"""A small RPC layer for the control plane: ``multiprocessing.connection`` over a Unix socket.

Only metadata crosses it (dicts of ints/strings). The server exposes a fixed set of
:class:`~shared_teacher.source.SharedTeacherSource` methods; each connection gets a thread, so a
blocking call (``next_window``) of one reader never delays another, and the HMAC handshake runs in
that thread too, so a client that stalls mid-handshake never blocks the accept loop. Errors come
back as the same typed exception. Every client wait has a timeout: connecting, the handshake
(``connect_timeout``) and each call (its own ``timeout`` + ``rpc_timeout``); a dead or hung
server fails the call with ``ConnectionError``, never hangs it. Pass ``address=(host, port)`` to
serve over TCP for readers on other hosts.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from shared_teacher import errors as _errors

__all__ = ["SourceServer", "SourceClient", "METHODS"]

METHODS = frozenset({"subscribe", "plan", "admit", "publish", "heartbeat", "next_window", "ack_read", "ack_step",
                     "fail_student", "leave", "stats", "register_owned_pids", "requeue_unpublished"})
_ERRORS = {name: getattr(_errors, name) for name in _errors.__all__}
_ERRORS.update(TimeoutError=TimeoutError, ValueError=ValueError, KeyError=KeyError, TypeError=TypeError)
_HANDSHAKE_S = 30.0
"""Server side: how long a new connection may take to authenticate before it is dropped."""


class _TimedConnection(Connection):
    """A connection whose ``recv_bytes`` (used only by the HMAC handshake; calls use ``recv``)
    waits at most ``handshake_timeout`` seconds for each message."""

    handshake_timeout = _HANDSHAKE_S

    def recv_bytes(self, maxlength=None):
        if not self.poll(self.handshake_timeout):
            raise ConnectionError(f"handshake: no message within {self.handshake_timeout:.1f}s")
        return super().recv_bytes(maxlength)


def _connect(address, family: str, authkey: bytes, timeout: float) -> _TimedConnection:
    """Connect and authenticate (both directions), each step bounded by ``timeout``."""
    sock = socket.socket(getattr(socket, family))
    try:
        sock.settimeout(timeout)
        sock.connect(address)
        sock.setblocking(True)
    except BaseException:
        sock.close()
        raise
    conn = _TimedConnection(sock.detach())
    conn.handshake_timeout = timeout
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except BaseException:
        conn.close()
        raise
    return conn


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
        # A plain listening socket (multiprocessing's Listener would run the handshake in the accept
        # loop, see _serve), with a deep backlog: with a backlog of 1, concurrent TCP connects get
        # SYN-dropped and back off for seconds.
        self._sock = socket.socket(getattr(socket, self.family))
        try:
            if self.family == "AF_INET":
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(address)
            self._sock.listen(128)
        except BaseException:
            self._sock.close()
            raise
        self.address = self._sock.getsockname()
        self._conns: list[Connection] = []
        self._conns_lock = threading.Lock()  # a connection is closed once, by whoever removes it
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="shared-teacher-rpc", daemon=True)
        self._thread.start()

    @property
    def connect_info(self) -> dict:
        return {"address": self.address, "family": self.family, "authkey": self.authkey.hex()}

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                continue
            if self._closed:
                sock.close()
                return
            sock.setblocking(True)
            conn = _TimedConnection(sock.detach())
            with self._conns_lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _drop(self, conn: Connection) -> None:
        """Close ``conn`` unless :meth:`close` already took it (two closes of one descriptor would
        close whatever reused its number)."""
        with self._conns_lock:
            if conn not in self._conns:
                return
            self._conns.remove(conn)
        conn.close()

    def _serve(self, conn: Connection) -> None:
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except Exception:  # noqa: BLE001 - a wrong key, a stalled or vanished client: drop this connection only
            self._drop(conn)
            return
        while True:
            try:
                method, kwargs = conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: closed under us by close()
                self._drop(conn)
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
                self._drop(conn)
                return

    def close(self) -> None:
        self._closed = True
        try:
            with socket.socket(socket.AF_INET if self.family == "AF_INET" else socket.AF_UNIX) as s:
                s.settimeout(1.0)
                s.connect(self.address)  # unblock accept()
        except OSError:
            pass
        self._sock.close()
        with self._conns_lock:
            conns, self._conns = self._conns, []
        for c in conns:
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

    def __init__(self, connect_info: dict, *, rpc_timeout: float = 120.0, connect_timeout: float = 30.0) -> None:
        family = connect_info.get("family", "AF_UNIX")
        address = tuple(connect_info["address"]) if family == "AF_INET" else connect_info["address"]
        try:
            self._conn = _connect(address, family, bytes.fromhex(connect_info["authkey"]), connect_timeout)
        except (OSError, EOFError) as err:  # refused, timed out, stalled or cut handshake
            raise ConnectionError(f"control plane at {address!r}: connect/handshake failed "
                                  f"(connect_timeout={connect_timeout:.1f}s): {type(err).__name__}: {err}") from None
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
