"""colocate: residency, Megatron → HF/SGLang weight publication, forked colocated workers.

Exports what a trainer calls; everything else is importable from its module (``colocate.errors``,
``colocate.convert``, ``colocate.megatron`` (``iter_hf_weights``), ``colocate.transports``, ``colocate.buckets``, ``colocate.sglang_clients``,
``colocate.awex_transport``, ...). ``import colocate`` needs neither CUDA, sglang, transformers
nor megatron.core (each imported when used).
"""

from colocate.config import EngineConfig, HFModelSpec, PublishConfig, WorkerSpec
from colocate.cycle import ColocatedCycle
from colocate.engines import HFEngine
from colocate.errors import (
    BusyError,
    ColocateError,
    ConfigError,
    NotResidentError,
    PoisonedVersionError,
    PublishError,
)
from colocate.megatron import megatron_residency_hooks, model_spec_from_megatron, publish_megatron
from colocate.protocol import RolloutEngine, WeightReceiver
from colocate.publish import Publisher, PublishReport
from colocate.residency import Residency
from colocate.sglang_engine import SGLangEngine
from colocate.transports import spawn_receiver
from colocate.workers import LocalScheduler, RayScheduler, SlurmScheduler

__all__ = [
    "ColocatedCycle", "Residency", "megatron_residency_hooks",
    "Publisher", "PublishConfig", "PublishReport", "publish_megatron", "spawn_receiver",
    "HFModelSpec", "model_spec_from_megatron",
    "WeightReceiver", "RolloutEngine", "HFEngine", "EngineConfig", "SGLangEngine",
    "WorkerSpec", "LocalScheduler", "SlurmScheduler", "RayScheduler",
    "ColocateError", "ConfigError", "PublishError", "PoisonedVersionError", "BusyError", "NotResidentError",
]
