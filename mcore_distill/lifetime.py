"""Child processes that end with their parent.

A rank killed with SIGKILL (preemption, an OOM killer, a test) runs no exit handlers, so helper
processes it started keep running, orphaned, unless they watch for it themselves. Linux's
``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process, so the
watch here polls the parent id instead.

The same holds one level up: torchrun starts each rank in a session of its own, so a SIGKILL of
torchrun (or of its process group) leaves the ranks running, holding their GPU memory and waiting
in collectives until their timeouts. :func:`end_with_launcher` makes a rank follow its launcher.
"""

from __future__ import annotations

import os
import threading
import time

__all__ = ["exit_with_parent", "end_with_launcher"]


def exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    """In the calling (child) process: end it with ``os._exit(1)`` once ``parent`` is no longer its
    parent, checked every ``poll_s`` seconds on a daemon thread (the child may be busy elsewhere,
    e.g. in a long load or serving a manager, and never read a pipe's EOF)."""
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="mcore-distill-parent-watch", daemon=True).start()


def end_with_launcher(poll_s: float = 0.5) -> bool:
    """In a rank started by torchrun (``TORCHELASTIC_RUN_ID`` set): end this process once torchrun,
    its parent, is gone (:func:`exit_with_parent`). Call it once, early in the rank's main. Returns
    whether the watch started (False outside torchrun, where the parent may be a shell)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return False
    exit_with_parent(os.getppid(), poll_s)
    return True
