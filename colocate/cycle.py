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

from dataclasses import dataclass

from colocate.errors import ConfigError
from colocate.protocol import RolloutEngine
from colocate.publish import Meta, Publisher, PublishReport, Weights
from colocate.residency import TRAINER_TAGS, Residency

__all__ = ["ColocatedCycle", "Handover"]


@dataclass(frozen=True)
class Handover:
    """Bytes per tag that :meth:`ColocatedCycle.to_training` moved."""

    engine_released: dict[str, int]
    trainer_resumed: dict[str, int]


class ColocatedCycle:
    """Orders residency transitions between a trainer and an engine around each publish.

    ``trainer``: a :class:`~colocate.residency.Residency` with tags ``optimizer``, ``grads``,
    ``weights`` (e.g. from :func:`colocate.megatron.megatron_residency_hooks`); ``engine``: a
    :class:`~colocate.protocol.RolloutEngine` (``release_memory`` / ``resume_memory`` over
    ``kv_cache``, ``weights``, ``cuda_graph``); ``publisher``: a :class:`~colocate.publish.Publisher`
    to that engine.
    """

    def __init__(self, trainer: Residency, engine: RolloutEngine, publisher: Publisher):
        missing = set(TRAINER_TAGS) - set(trainer.tags)
        if missing:
            raise ConfigError(f"ColocatedCycle: trainer residency lacks tags {sorted(missing)}")
        self.trainer, self.engine, self.publisher = trainer, engine, publisher

    def to_training(self) -> Handover:
        """Engine gives up its memory (raises ``BusyError`` if it is generating), trainer resumes."""
        freed = self.engine.release_memory(["kv_cache", "weights", "cuda_graph"])
        return Handover(engine_released=freed, trainer_resumed=self.trainer.resume())

    def publish(self, weights: Weights, *, version: int, meta: Meta | None = None) -> PublishReport:
        """Run the publish half of the cycle (see module docstring) and return the report. On
        :class:`~colocate.errors.PublishError` it stops there: trainer weights resident, engine
        ``kv_cache``/``cuda_graph`` released."""
        self.trainer.release(["optimizer", "grads"])
        self.engine.resume_memory(["weights"])
        report = self.publisher.publish(weights, version=version, meta=meta)
        self.trainer.release(["weights"])
        self.engine.resume_memory(["cuda_graph", "kv_cache"])
        return report
