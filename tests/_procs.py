"""Linux ``/proc`` readers for the tests that check which processes are left after a fault
(no orphan servers, process groups gone, the real server process to kill)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


class Stat(NamedTuple):
    """The fields of ``/proc/<pid>/stat`` the tests read."""

    state: str
    ppid: int
    pgid: int


def pids() -> Iterator[int]:
    """Every process id in ``/proc`` now."""
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            yield int(d.name)


def stat(pid: int) -> Stat | None:
    """State, parent and process group of ``pid``; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return Stat(fields[0], int(fields[1]), int(fields[2]))
    except (OSError, IndexError, ValueError):
        return None


def argv(pid: int) -> list[bytes] | None:
    """The command line of ``pid`` as its arguments; None once it is gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone: reaping is its parent's business)."""
    return (s := stat(pid)) is not None and s.state != "Z"


def gone_within(pids_: list[int], timeout: float) -> list[int]:
    """Poll until none of ``pids_`` is alive or ``timeout`` seconds passed; the ones still alive."""
    deadline = time.monotonic() + timeout
    left = [p for p in pids_ if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of the process group ``pgid``."""
    return [p for p in pids() if (s := stat(p)) is not None and s.pgid == pgid and s.state != "Z"]


def group_gone(pgid: int, timeout: float = 10.0) -> bool:
    """True once no process of the process group ``pgid`` is left (zombies aside)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not group_pids(pgid):
            return True
        time.sleep(0.1)
    return False


def child_running(ppid: int, module: str) -> int | None:
    """The child of ``ppid`` that runs ``python -m module`` (e.g. a guard's server process, not
    the guard's watcher fork); None if there is none."""
    want = [b"-m", module.encode()]
    for p in pids():
        s, a = stat(p), argv(p)
        if s is not None and a is not None and s.ppid == ppid and a[1:3] == want:
            return p
    return None
