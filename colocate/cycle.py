"""The canonical colocated cycle, enforced in one place.

::

    to_training():      engine  release kv_cache, weights, cuda_graph   (refused while generating)
                        trainer resume  weights, grads, optimizer
    ... train step(s), checkpoint ...
    publish(weights):   trainer release optimizer, grads
                        engine  resume  weights
                        publisher.publish(weights, version)            (trainer weights still resident)
                        trainer release weights
                        engine  resume  cuda_graph, kv_cache
    ... rollout ...

If the publish fails, the cycle stops with the trainer weights resident and the engine's
``kv_cache``/``cuda_graph`` released, so the caller can publish a newer version (or restore the
engine from disk) before rollout; the failed version stays poisoned.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from colocate.publish import Publisher, PublishReport
from colocate.residency import Residency

__all__ = ["ColocatedCycle"]


class ColocatedCycle:
    """Orders residency transitions between a trainer and an engine around each publish.

    ``trainer``: a :class:`~colocate.residency.Residency` with tags ``optimizer``, ``grads``,
    ``weights`` (e.g. from :func:`colocate.megatron.megatron_residency_hooks`); ``engine``: an
    object with ``release_memory`` / ``resume_memory`` over ``kv_cache``, ``weights``,
    ``cuda_graph``; ``publisher``: a :class:`~colocate.publish.Publisher` to that engine.
    """

    def __init__(self, trainer: Residency, engine, publisher: Publisher):
        missing = {"optimizer", "grads", "weights"} - set(trainer.tags)
        if missing:
            raise ValueError(f"ColocatedCycle: trainer residency lacks tags {sorted(missing)}")
        self.trainer, self.engine, self.publisher = trainer, engine, publisher

    def to_training(self) -> dict[str, dict[str, int]]:
        """Engine gives up its memory (raises ``BusyError`` if it is generating), trainer resumes."""
        freed = self.engine.release_memory(["kv_cache", "weights", "cuda_graph"])
        restored = self.trainer.resume()
        return {"engine_released": freed, "trainer_resumed": restored}

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *, version: int,
                meta: Mapping | None = None) -> PublishReport:
        """Run the publish half of the cycle (see module docstring) and return the report."""
        self.trainer.release(["optimizer", "grads"])
        self.engine.resume_memory(["weights"])
        report = self.publisher.publish(weights, version=version, meta=meta)
        self.trainer.release(["weights"])
        self.engine.resume_memory(["cuda_graph", "kv_cache"])
        return report
