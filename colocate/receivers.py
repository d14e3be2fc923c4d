"""The smallest complete receiver: one tensor per name, filled by copies.

:class:`TensorReceiver` implements the weight-receiver protocol (``param_specs``,
``begin_update``/``load_bucket``/``end_update``, ``weight_version``, ``checksums``) without a
model behind it: what a publisher delivers can be checked bit for bit, and a benchmark times the
one device copy every real engine's load does. Run it in process or behind
:func:`colocate.transports.spawn_receiver`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from colocate.buckets import copy_tensors, tensor_checksum, unpack_bucket

__all__ = ["TensorReceiver"]


class TensorReceiver:
    """Holds ``specs`` (name → (shape, dtype)) as zero tensors on ``device``; every load copies
    into them (:func:`~colocate.buckets.copy_tensors`) and synchronizes a CUDA device before it
    returns, so an acknowledgement means "copied". Updates are not staged: an aborted update may
    have written some tensors (use :class:`~colocate.engines.HFEngine` for atomic commits)."""

    def __init__(self, specs: dict, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.specs = specs
        self.params = {n: torch.zeros(s, dtype=d, device=self.device) for n, (s, d) in specs.items()}
        self.version: int | None = None

    def capabilities(self) -> frozenset[str]:
        # behind a RemoteReceiver "inprocess" is dropped
        return frozenset({"cuda_ipc"} if self.device.type == "cuda" else {"inprocess", "shm"})

    def param_specs(self) -> dict:
        return self.specs

    def begin_update(self, version: int) -> None:
        pass

    def load_bucket(self, entries, buffer: torch.Tensor) -> None:
        self.load_views(unpack_bucket(buffer, entries))

    def load_views(self, views: dict[str, torch.Tensor]) -> None:
        """Copy named views (of a bucket or a storage shared in place) into the tensors; the
        serving loop of a kept-mapped slot builds them once (:func:`~colocate.transports.serve_receiver`)."""
        copy_tensors([self.params[n] for n in views], list(views.values()), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def end_update(self, version: int, checksums: dict[str, int] | None) -> None:
        self.version = version

    def abort_update(self, version: int) -> None:
        if self.version == version:  # committed before the publisher gave up: not a valid version
            self.version = None

    def weight_version(self) -> int | None:
        return self.version

    def checksums(self, names: Iterable[str] | None = None) -> dict[str, int]:
        return {n: tensor_checksum(self.params[n]) for n in (names or self.params)}
