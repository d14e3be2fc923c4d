"""Atomic checkpoint files and directories (temp + fsync + rename), and a model-space state view.

Megatron checkpoints go through ``DistributedOptimizer.sharded_state_dict`` with the
``fully_reshardable`` sharding type: each parameter's ``fp32_param`` / ``exp_avg`` /
``exp_avg_sq`` is a canonical model-space tensor, so a checkpoint saved at one DP size loads at
another (see :func:`optim_staged.megatron.save_checkpoint`). This module holds the torch-only
pieces: atomic writes and the per-parameter state of a standalone staged optimizer.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["atomic_torch_save", "fsync_tree", "publish_directory", "model_space_state", "AsyncSave", "async_save",
           "LAYOUT_FILE",
           "parallel_layout", "write_layout", "check_layout"]

LAYOUT_FILE = "optim_staged_layout.json"
"""Written next to the ``dist_checkpointing`` files: the parallel layout the checkpoint was saved at."""
LAYOUT_FORMAT = 1
_LAYOUT_FIXED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size")


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (and ``root`` itself)."""
    root = Path(root)
    for dirpath, _, files in os.walk(root):
        for f in files:
            _fsync_path(Path(dirpath) / f)
        _fsync_path(Path(dirpath))


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path.tmp-<pid>``, fsync, then rename over ``path`` and fsync the folder:
    readers see the old file or the complete new one, never a partial write."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_path(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


def publish_directory(tmp_dir: str | os.PathLike, final_dir: str | os.PathLike) -> None:
    """fsync ``tmp_dir`` and rename it to ``final_dir``; an existing ``final_dir`` is moved aside
    first and deleted only after the new one is in place."""
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    fsync_tree(tmp_dir)
    old = final_dir.with_name(f"{final_dir.name}.old-{os.getpid()}")
    if final_dir.exists():
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    _fsync_path(final_dir.parent)
    if old.exists():
        shutil.rmtree(old)


def model_space_state(optimizer: torch.optim.Optimizer, names: dict[int, str], *,
                      clone: bool = True) -> dict[str, dict[str, Any]]:
    """``{param name: {state key: fp32 CPU tensor (param shape), 'step': int}}`` of a staged
    optimizer; ``names`` maps ``id(param)`` to its name. Drains first. ``clone=False`` returns
    views of the host slabs (valid until the optimizer next writes them)."""
    optimizer.drain(release=False)
    out: dict[str, dict[str, Any]] = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in names:
                raise KeyError(f"parameter of shape {tuple(p.shape)} has no name in `names`")
            out[names[id(p)]] = {**{k: (v.detach().clone() if clone else v.detach())
                                    for k, v in optimizer.state[p].items()},
                                 "step": int(g["step"])}
    return out


def parallel_layout(model_config: Any, *, data_parallel_size: int) -> dict[str, int]:
    """The layout fields of a Megatron ``TransformerConfig`` (TP, PP, EP sizes) plus the DP size."""
    out = {k: int(getattr(model_config, k, 1) or 1) for k in _LAYOUT_FIXED}
    out["data_parallel_size"] = int(data_parallel_size)
    out["format"] = LAYOUT_FORMAT
    return out


def write_layout(directory: str | os.PathLike, layout: dict[str, int]) -> None:
    """Write ``layout`` as ``<directory>/optim_staged_layout.json`` (temp + fsync + rename)."""
    import json

    path = Path(directory) / LAYOUT_FILE
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(layout, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def check_layout(directory: str | os.PathLike, current: dict[str, int]) -> dict[str, int]:
    """Refuse a checkpoint whose TP / PP / EP sizes differ from ``current`` (DP may differ: the
    optimizer state is stored per parameter in model space). Returns the saved layout.

    Raises :class:`~optim_staged.config.CheckpointLayoutError` naming the field, the saved value
    and this run's value, or when the layout record is missing or of another format.
    """
    import json

    from optim_staged.config import CheckpointLayoutError

    path = Path(directory) / LAYOUT_FILE
    if not path.exists():
        raise CheckpointLayoutError(
            f"{directory}: no {LAYOUT_FILE}; not written by optim_staged.megatron.save_checkpoint")
    saved = json.loads(path.read_text())
    if saved.get("format") != LAYOUT_FORMAT:
        raise CheckpointLayoutError(f"{path}: format={saved.get('format')!r}, this version reads {LAYOUT_FORMAT}")
    for k in _LAYOUT_FIXED:
        if int(saved.get(k, 1)) != int(current.get(k, 1)):
            raise CheckpointLayoutError(
                f"checkpoint {directory} was saved with {k}={saved.get(k)}, this run has {k}={current.get(k)}: "
                "optimizer state reshards across data-parallel sizes only (TP/PP/EP changes are refused)")
    return saved


class AsyncSave:
    """A checkpoint write running on a background thread (see :func:`async_save`)."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s
        self.error: BaseException | None = None
        self._thread: Any = None

    def done(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the file is written (at most ``timeout`` s, default ``timeout_s``); raises
        ``TimeoutError`` if it is still running, or the writer's own exception."""
        t = self.timeout_s if timeout is None else timeout
        self._thread.join(t)
        if self._thread.is_alive():
            raise TimeoutError(f"async checkpoint save to {self.path} still running after {t} s")
        if self.error is not None:
            raise self.error


def async_save(optimizer: torch.optim.Optimizer, names: dict[int, str], path: str | os.PathLike, *,
               mode: str = "fence", timeout_s: float = 600.0) -> AsyncSave:
    """Write :func:`model_space_state` to ``path`` (atomically) on a background thread.

    ``mode='snapshot'`` copies the state first (12 B/param of extra host RAM for AdamW) and the
    optimizer runs on at once. ``mode='fence'`` copies nothing: the writer reads the host slabs in
    place, and the optimizer's next state-writing call (``step``, ``load_state_dict``,
    ``set_scaled_state``, ``set_slot_config``) waits for the write, up to ``timeout_s``. Either
    way the file holds the state as of this call. Returns a handle with ``wait()`` / ``done()``.
    """
    import threading

    if mode not in ("fence", "snapshot"):
        raise ValueError(f"mode={mode!r} is invalid: one of fence|snapshot")
    state = model_space_state(optimizer, names, clone=(mode == "snapshot"))
    handle = AsyncSave(Path(path), timeout_s)

    def write() -> None:
        try:
            atomic_torch_save(state, handle.path)
        except BaseException as e:  # noqa: BLE001 - re-raised by wait()
            handle.error = e

    handle._thread = threading.Thread(target=write, name=f"optim_staged-save-{Path(path).name}", daemon=True)
    if mode == "fence":
        optimizer.add_fence(handle)
    handle._thread.start()
    return handle
