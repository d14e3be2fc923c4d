"""Checkpoint pieces that need only torch: atomic files and directories (from
:mod:`mcore_distill.atomic`), the per-parameter state of a standalone staged optimizer, its
background save, and the parallel-layout record of a Megatron checkpoint.

Megatron checkpoints go through ``DistributedOptimizer.sharded_state_dict`` with the
``fully_reshardable`` sharding type: each parameter's ``fp32_param`` / ``exp_avg`` /
``exp_avg_sq`` is a canonical model-space tensor, so a checkpoint saved at one DP size loads at
another (see :func:`optim_staged.megatron.save_checkpoint`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from mcore_distill.atomic import (
    atomic_torch_save,
    atomic_write_json,
    fsync_tree,
    publish_directory,
    remove_stale_files,
)

__all__ = ["atomic_torch_save", "fsync_tree", "publish_directory", "model_space_state", "AsyncSave", "async_save",
           "LAYOUT_FILE", "LAYOUT_FIELDS", "LAYOUT_FIXED",
           "parallel_layout", "write_layout", "read_layout", "check_layout"]

# atomic_torch_save / fsync_tree / publish_directory are mcore_distill.atomic's (re-exported here
# under their old names): crash-safe at every step of the directory switch, see that module.

LAYOUT_FILE = "optim_staged_layout.json"
"""Written next to the ``dist_checkpointing`` files: the parallel layout the checkpoint was saved at."""
LAYOUT_FORMAT = 2
_READABLE_FORMATS = (1, 2)  # format 1 recorded TP/PP/EP (from TransformerConfig) and DP only
LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                 "expert_tensor_parallel_size", "context_parallel_size", "data_parallel_size",
                 "expert_data_parallel_size")
"""Process-group sizes a layout records (read from Megatron's parallel state when saving)."""
LAYOUT_FIXED = LAYOUT_FIELDS[:4]
"""Sizes that must match on load: they change parameter shapes or which rank owns which expert.
DP (and CP, and with it the expert DP size) may differ: optimizer state is stored per parameter
in model space."""


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


def parallel_layout(**sizes: int) -> dict[str, int]:
    """A layout record: the given process-group sizes (names from :data:`LAYOUT_FIELDS`, each an
    int >= 1) plus the format number."""
    from optim_staged.config import CheckpointLayoutError

    out: dict[str, int] = {}
    for k, v in sizes.items():
        if k not in LAYOUT_FIELDS:
            raise CheckpointLayoutError(f"layout field {k!r} is unknown: one of {', '.join(LAYOUT_FIELDS)}")
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CheckpointLayoutError(f"layout field {k}={v!r} is invalid: must be an int >= 1")
        out[k] = v
    out["format"] = LAYOUT_FORMAT
    return out


def write_layout(directory: str | os.PathLike, layout: dict[str, int]) -> None:
    """Write ``layout`` as ``<directory>/optim_staged_layout.json`` (temp + fsync + rename)."""
    atomic_write_json(Path(directory) / LAYOUT_FILE, layout)


def read_layout(directory: str | os.PathLike) -> dict[str, int]:
    """The layout record of a checkpoint directory; :class:`CheckpointLayoutError` when it is
    missing or of a format this version cannot read."""
    from optim_staged.config import CheckpointLayoutError

    path = Path(directory) / LAYOUT_FILE
    if not path.exists():
        raise CheckpointLayoutError(
            f"{directory}: no {LAYOUT_FILE}; not written by optim_staged.megatron.save_checkpoint")
    saved = json.loads(path.read_text())
    if saved.get("format") not in _READABLE_FORMATS:
        raise CheckpointLayoutError(
            f"{path}: format={saved.get('format')!r}, this version reads {list(_READABLE_FORMATS)}")
    return saved


def _describe(layout: dict[str, int]) -> str:
    short = {"tensor_model_parallel_size": "TP", "pipeline_model_parallel_size": "PP",
             "expert_model_parallel_size": "EP", "expert_tensor_parallel_size": "ETP",
             "context_parallel_size": "CP", "data_parallel_size": "DP", "expert_data_parallel_size": "EDP"}
    return " ".join(f"{short[k]}={layout[k]}" for k in LAYOUT_FIELDS if k in layout)


def check_layout(directory: str | os.PathLike, current: dict[str, int]) -> dict[str, int]:
    """Refuse a checkpoint whose TP / PP / EP / expert-TP sizes differ from ``current`` (DP and CP
    may differ: the optimizer state is stored per parameter in model space). Returns the saved
    layout. A field that the saved record lacks (format 1 has no expert-TP) is not compared.

    Raises :class:`~optim_staged.config.CheckpointLayoutError` naming the field, the saved value
    and this run's value, and both layouts; or when the record is missing or of another format.
    """
    from optim_staged.config import CheckpointLayoutError

    saved = read_layout(directory)
    for k in LAYOUT_FIXED:
        if k in saved and k in current and int(saved[k]) != int(current[k]):
            raise CheckpointLayoutError(
                f"checkpoint {directory} was saved with {k}={saved[k]}, this run has {k}={current[k]} "
                f"(saved layout: {_describe(saved)}; this run: {_describe(current)}): optimizer state "
                "reshards across data-parallel sizes only (TP/PP/EP/expert-TP changes are refused)")
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
    Temporaries that killed writers left in the folder are deleted first.
    """
    import threading

    if mode not in ("fence", "snapshot"):
        raise ValueError(f"mode={mode!r} is invalid: one of fence|snapshot")
    remove_stale_files(Path(path).parent)  # temporaries of saves whose process died
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
