"""AWEX 0.9.0 wrapped as a colocated Megatron → inference publication path.

AWEX moves weights with its own writer (trainer side), reader (inside each inference worker)
and a NCCL transfer plan between them. Three things in 0.9.0 stop it from working colocated as
shipped, and this module fixes each by subclassing, never by editing AWEX:

1. ``MegatronEngine`` leaves its memory hooks unimplemented (``resume_memory_occupation`` and
   ``release_grad_memory`` raise, ``release_memory_occupation`` does nothing).
   :func:`resident_megatron_engine` returns a subclass that drives a
   :class:`colocate.residency.Residency` (tags ``optimizer``, ``weights``, ``grads``;
   idempotent; a bare string tag accepted, as AWEX's own writers pass one).
2. ``NCCLWeightsWriter._init_writer_in_colocate_mode`` reads an attribute that is never set
   (``asystem_train_config``). The engine subclass builds a writer subclass that exposes the
   engine's config under that name.
3. The reader's default colocated transport clones every remote send slice while it builds the
   plan (≈7/8 of the model retained per GPU on an 8-way colocated update).
   :func:`bounded_reader_class` subclasses ``NCCLWorkerWeightsReader`` so that
   ``create_colocate_transport()`` returns AWEX's ``BoundedMemoryNcclColocateStreamBatchTransport``
   (one clone per active peer at a time); :func:`install_bounded_reader` makes AWEX's reader
   factory pick that subclass in the process it runs in (an inference worker: run it there,
   e.g. through ``Engine.execute_task_in_model_worker``, before AWEX builds its reader). Every
   reader of a colocated group must use the same transport, so install it on all of them.

What is available is decided by probing the installed package and the machine
(:func:`awex_capabilities`), not by version strings. ``awex`` is imported lazily.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable

import torch

from colocate.errors import AwexUnavailable

__all__ = ["AwexUnavailable", "awex_capabilities", "resident_megatron_engine", "bounded_reader_class",
           "install_bounded_reader", "AWEX_MEMORY_TAGS"]

AWEX_MEMORY_TAGS = ("optimizer", "weights")
"""The tags AWEX's engine API passes to ``release/resume_memory_occupation``."""


def _attr(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name, None)
    except Exception:  # noqa: BLE001 - AWEX imports fail for many reasons (missing deps): not present
        return None


def awex_capabilities() -> frozenset[str]:
    """Feature probe of the installed AWEX and this machine.

    * ``engine.mcore``: ``awex.engine.mcore.MegatronEngine`` with the three memory hooks;
    * ``writer.nccl_colocate``: ``NCCLWeightsWriter`` with ``_init_writer_in_colocate_mode``;
    * ``reader.transport_hook``: ``NCCLWorkerWeightsReader.create_colocate_transport`` (override point);
    * ``transport.bounded``: ``BoundedMemoryNcclColocateStreamBatchTransport``;
    * ``plan.builder``: ``TransferPlanBuilder.build_local_transfer_plan``;
    * ``sglang.hooks``: ``awex.engine.sglang.install_sglang_worker_hooks`` and ``sglang`` importable;
    * ``ipc.cuda``: CUDA present (AWEX's colocated writer shares weights by CUDA IPC).
    """
    if importlib.util.find_spec("awex") is None:
        return frozenset()
    caps = set()
    eng = _attr("awex.engine.mcore", "MegatronEngine")
    if eng is not None and all(hasattr(eng, h) for h in ("release_memory_occupation", "resume_memory_occupation",
                                                         "release_grad_memory")):
        caps.add("engine.mcore")
    writer = _attr("awex.writer.nccl_writer", "NCCLWeightsWriter")
    if writer is not None and hasattr(writer, "_init_writer_in_colocate_mode"):
        caps.add("writer.nccl_colocate")
    reader = _attr("awex.reader.nccl_reader", "NCCLWorkerWeightsReader")
    if reader is not None and callable(getattr(reader, "create_colocate_transport", None)):
        caps.add("reader.transport_hook")
    bounded = _attr("awex.transfer.nccl_bounded_stream", "BoundedMemoryNcclColocateStreamBatchTransport")
    if bounded is not None and hasattr(bounded, "update_weights_in_colocate_mode"):
        caps.add("transport.bounded")
    builder = _attr("awex.transfer.transfer_plan", "TransferPlanBuilder")
    if builder is not None and hasattr(builder, "build_local_transfer_plan"):
        caps.add("plan.builder")
    if _attr("awex.engine.sglang", "install_sglang_worker_hooks") is not None and \
            importlib.util.find_spec("sglang") is not None:
        caps.add("sglang.hooks")
    if torch.cuda.is_available():
        caps.add("ipc.cuda")
    return frozenset(caps)


def _require(*features: str) -> None:
    caps = awex_capabilities()
    missing = [f for f in features if f not in caps]
    if missing:
        raise AwexUnavailable(f"AWEX feature(s) {missing} not available (probed: {sorted(caps)})")


def _tags(tags) -> list[str]:
    tags = list(AWEX_MEMORY_TAGS) if tags is None else [tags] if isinstance(tags, str) else list(tags)
    bad = [t for t in tags if t not in AWEX_MEMORY_TAGS]
    if bad:
        raise ValueError(f"AWEX memory tags must be 'optimizer' or 'weights', got {bad}")
    return tags


def resident_megatron_engine(config: dict, hf_config, model, *, residency):
    """AWEX ``MegatronEngine`` with working memory hooks and a colocated writer that starts.

    ``residency``: a :class:`colocate.residency.Residency` over the trainer (e.g. from
    :func:`colocate.megatron.megatron_residency_hooks`) with tags ``optimizer``, ``weights``,
    ``grads``. ``release_memory_occupation(tags)`` / ``resume_memory_occupation(tags)`` take
    ``optimizer``/``weights`` (None = both, a bare string accepted); ``release_grad_memory``
    releases ``grads``. All are idempotent (the residency's rules). ``initialize()`` builds AWEX's
    writer, replacing the NCCL writer by a subclass whose colocated init finds its config.
    """
    _require("engine.mcore")
    from awex.engine.mcore import MegatronEngine
    from awex.util import device as device_util
    from awex.writer.weights_writer import get_weights_exchange_writer

    class ResidentMegatronEngine(MegatronEngine):
        """AWEX's Megatron engine with its memory hooks mapped onto a ``Residency``."""

        def initialize(self) -> None:
            writer = get_weights_exchange_writer(self)
            fixed = colocated_writer_class(type(writer))
            if fixed is not type(writer):
                writer.__class__ = fixed
            self.weights_exchange_writer = writer
            writer.initialize()
            if self.enable_colocate_mode:
                self.release_memory_occupation()

        def release_memory_occupation(self, tags=None) -> None:
            residency.release(_tags(tags))
            if device_util.get_device_type() == "cuda":
                torch.cuda.empty_cache()

        def resume_memory_occupation(self, tags=None) -> None:
            residency.resume(_tags(tags))

        def release_grad_memory(self, empty_cache: bool = True) -> None:
            residency.release(["grads"])
            if empty_cache and device_util.get_device_type() == "cuda":
                torch.cuda.empty_cache()

    return ResidentMegatronEngine(config, hf_config, model)


def colocated_writer_class(writer_cls: type) -> type:
    """``writer_cls`` itself, or (for AWEX's NCCL writer, whose colocated init reads the unset
    ``asystem_train_config``) a subclass exposing the engine config under that name."""
    if not hasattr(writer_cls, "_init_writer_in_colocate_mode") or hasattr(writer_cls, "asystem_train_config"):
        return writer_cls

    class ColocatedNcclWriter(writer_cls):
        """AWEX's NCCL writer whose colocated init reads the engine config it was given."""

        @property
        def asystem_train_config(self) -> dict:
            return self.config

    ColocatedNcclWriter.__name__ = f"Colocated{writer_cls.__name__}"
    return ColocatedNcclWriter


def bounded_reader_class() -> type:
    """Subclass of AWEX's ``NCCLWorkerWeightsReader`` whose colocated transport is the bounded
    one (``BoundedMemoryNcclColocateStreamBatchTransport``)."""
    _require("reader.transport_hook", "transport.bounded")
    from awex.reader.nccl_reader import NCCLWorkerWeightsReader
    from awex.transfer.nccl_bounded_stream import BoundedMemoryNcclColocateStreamBatchTransport

    base = NCCLWorkerWeightsReader
    while getattr(base, "_colocate_bounded", False):  # already installed: subclass the original
        base = base.__mro__[1]

    class BoundedNCCLWorkerWeightsReader(base):
        """AWEX's NCCL reader with the bounded-memory colocated transport."""

        _colocate_bounded = True

        def create_colocate_transport(self):
            return BoundedMemoryNcclColocateStreamBatchTransport(self.transfer_rank, self.infer_world_size)

    return BoundedNCCLWorkerWeightsReader


def install_bounded_reader() -> Callable[[], None]:
    """Make AWEX build :func:`bounded_reader_class` readers in this process (its reader factory
    imports ``awex.reader.nccl_reader.NCCLWorkerWeightsReader`` when it runs). Idempotent;
    returns a function that restores the original class."""
    import awex.reader.nccl_reader as nccl_reader

    current = nccl_reader.NCCLWorkerWeightsReader
    if getattr(current, "_colocate_bounded", False):
        original = current.__mro__[1]
    else:
        original = current
        nccl_reader.NCCLWorkerWeightsReader = bounded_reader_class()

    def undo() -> None:
        nccl_reader.NCCLWorkerWeightsReader = original

    return undo
