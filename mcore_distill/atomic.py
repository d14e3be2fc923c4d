"""Atomic, crash-safe writes of files and directories (temp + fsync + rename).

Files: :func:`atomic_write` writes ``path`` through a temporary sibling, fsyncs it, renames it over
``path`` and fsyncs the folder, so a reader (or a run after ``kill -9``) sees the old file or the
complete new one, never a partial write. :func:`atomic_write_bytes`, :func:`atomic_write_json` and
:func:`atomic_torch_save` are the one-call forms.

Directories: :func:`publish_directory` switches a complete temporary directory in as ``final``.
The switch is crash-safe at every step:

1. the writer fills ``<final>.tmp-<token>`` (a crash leaves an incomplete temp that is never read);
2. it is fsynced and renamed to ``<final>.ready-<token>``: a ``ready`` directory is complete;
3. if ``final`` exists, the two are exchanged in one ``renameat2(RENAME_EXCHANGE)``, so ``final`` is
   always a complete directory (old or new); otherwise ``ready`` is renamed to ``final``;
4. the old copy is renamed to ``<final>.old-<token>`` and deleted.

Where the file system cannot exchange (``EINVAL``/``ENOSYS``), step 3 moves ``final`` aside to
``.old-<token>`` first; a crash between the two renames leaves no ``final`` but two complete
copies, and :func:`recover_directory` (run by loaders and by the next save) renames the newest
complete one back. :func:`remove_stale` deletes temporaries whose writer is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "fsync_path",
    "fsync_tree",
    "atomic_write",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_torch_save",
    "new_token",
    "temp_directory_for",
    "publish_directory",
    "recover_directory",
    "remove_stale",
    "remove_stale_files",
]

_KINDS = ("tmp", "ready", "old")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def fsync_path(path: str | os.PathLike) -> None:
    """fsync one file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fsync_path(os.path.join(dirpath, f))
        fsync_path(dirpath)


def new_token() -> str:
    """``<time_ns>-<host>-<pid>``: orders temporaries by age and names their writer."""
    host = socket.gethostname().replace("-", "_").replace(".", "_") or "host"
    return f"{time.time_ns()}-{host}-{os.getpid()}"


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary sibling of ``path`` for writing; on a clean exit fsync it, rename it over
    ``path`` and fsync the folder. On an exception the temporary is removed and ``path`` is
    untouched."""
    if not mode.startswith("w"):
        raise ValueError(f"atomic_write mode must start with 'w', got {mode!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{new_token()}")
    try:
        with open(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_write(path, "wb") as f:
        f.write(data)


def atomic_write_json(path: str | os.PathLike, payload: Any, *, indent: int | None = 1,
                      default: Any = None) -> None:
    """Write ``payload`` as JSON (sorted keys; ``default`` as in :func:`json.dump`) to ``path``
    atomically."""
    with atomic_write(path, "w") as f:
        json.dump(payload, f, indent=indent, sort_keys=True, default=default)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj)`` to ``path`` atomically."""
    import torch

    with atomic_write(path, "wb") as f:
        torch.save(obj, f)


# ---------------------------------------------------------------------------------------------
# directories


def _sibling(final: Path, kind: str, token: str) -> Path:
    return final.with_name(f"{final.name}.{kind}-{token}")


def _siblings(final: Path) -> list[tuple[str, str, Path]]:
    """``(kind, token, path)`` of the temporaries of ``final``, oldest first."""
    out = []
    if not final.parent.is_dir():
        return out
    for p in final.parent.iterdir():
        for kind in _KINDS:
            prefix = f"{final.name}.{kind}-"
            if p.name.startswith(prefix) and p.is_dir():
                out.append((kind, p.name[len(prefix):], p))
    return sorted(out, key=lambda t: _age_key(t[1]))


def _age_key(token: str) -> int:
    head = token.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


def temp_directory_for(final: str | os.PathLike, token: str | None = None) -> Path:
    """A fresh ``<final>.tmp-<token>`` directory (created) to be filled and then published.
    Ranks that write one checkpoint together must share ``token`` (e.g. broadcast rank 0's)."""
    final = Path(final)
    tmp = _sibling(final, "tmp", token or new_token())
    tmp.mkdir(parents=True, exist_ok=True)
    return tmp


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with ``renameat2(RENAME_EXCHANGE)``; False where unsupported."""
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def publish_directory(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike, *,
                      exchange: bool = True) -> None:
    """Make the complete directory ``tmp_dir`` (from :func:`temp_directory_for`, or any sibling
    of ``final_dir``) become ``final_dir``; at every instant ``final_dir`` is the old or the new
    complete directory (or, without ``exchange`` support, recoverable by
    :func:`recover_directory`). ``exchange=False`` forces the two-rename fallback (tests)."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    token = tmp_dir.name.rsplit(".tmp-", 1)[-1] if ".tmp-" in tmp_dir.name else new_token()
    fsync_tree(tmp_dir)
    ready = _sibling(final_dir, "ready", token)
    os.replace(tmp_dir, ready)
    fsync_path(final_dir.parent)
    old = _sibling(final_dir, "old", token)
    if not final_dir.exists():
        os.replace(ready, final_dir)
    elif exchange and _exchange(ready, final_dir):
        os.replace(ready, old)  # `ready` now holds the previous directory
    else:
        os.replace(final_dir, old)
        os.replace(ready, final_dir)
    fsync_path(final_dir.parent)
    if old.exists():
        shutil.rmtree(old)


def recover_directory(final_dir: str | os.PathLike) -> Path | None:
    """If ``final_dir`` is missing but a complete copy survives a crashed switch (``.ready-*``
    first, then ``.old-*``, newest first), rename it back. Returns ``final_dir`` when it exists
    afterwards, else None. Safe to call from several processes at once."""
    final_dir = Path(final_dir)
    if final_dir.exists():
        return final_dir
    by_kind = {k: [p for kind, _, p in reversed(_siblings(final_dir)) if kind == k] for k in _KINDS}
    for cand in by_kind["ready"] + by_kind["old"]:
        try:
            os.rename(cand, final_dir)
        except OSError:
            if final_dir.exists():  # another process recovered first
                return final_dir
            continue
        fsync_path(final_dir.parent)
        return final_dir
    return final_dir if final_dir.exists() else None


def _writer_alive(token: str) -> bool:
    parts = token.split("-")
    if len(parts) < 3 or not parts[-1].isdigit():
        return False
    host, pid = "-".join(parts[1:-1]), int(parts[-1])
    me = socket.gethostname().replace("-", "_").replace(".", "_") or "host"
    if host != me:
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(final_dir: str | os.PathLike, *, keep_alive: bool = True) -> list[Path]:
    """Delete the temporaries of ``final_dir`` left by saves that died (``.tmp-*``, and
    ``.ready-*``/``.old-*`` once ``final_dir`` exists). With ``keep_alive`` a temporary whose
    writer is a live process on this host is kept. Returns the deleted paths. Call it after
    :func:`recover_directory`, from the single process that owns the checkpoint path."""
    final_dir = Path(final_dir)
    removed = []
    for kind, token, path in _siblings(final_dir):
        if kind != "tmp" and not final_dir.exists():
            continue
        if keep_alive and _writer_alive(token):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def remove_stale_files(folder: str | os.PathLike, *, keep_alive: bool = True) -> list[Path]:
    """Delete the temporaries that :func:`atomic_write` left in ``folder`` when its writer died
    (``.<name>.tmp-<token>``); with ``keep_alive`` those of live writers on this host stay."""
    removed = []
    folder = Path(folder)
    if folder.is_dir():
        for p in folder.glob(".*.tmp-*"):
            if p.is_file() and not (keep_alive and _writer_alive(p.name.rsplit(".tmp-", 1)[-1])):
                p.unlink(missing_ok=True)
                removed.append(p)
    return removed
