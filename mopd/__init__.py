"""mopd: multi-teacher on-policy distillation for Megatron-Core trainers.

Exports what a trainer calls: the configs, the teacher pool and its back-ends, routing, the
sampled-token and full-vocabulary losses, pre-flight, the Megatron hook and the two catch-all
errors. The Megatron names (:mod:`mopd.megatron`) are loaded on first use, so ``import mopd``
does not import Megatron-Core. Everything else is imported from its module: every error from
:mod:`mopd.errors`; route helpers (``derive``, ``verify_routes``, ``TargetAccumulator``...) from
:mod:`mopd.routing`; ``compose_losses`` and ``PGOutput`` from :mod:`mopd.objectives`; pool
states and leases from :mod:`mopd.teachers`; ``MegatronTeacher`` (one teacher built by hand,
``build_teacher_pool`` makes them), ``save_teacher_checkpoint`` and ``token_logprobs`` from
:mod:`mopd.megatron`; fingerprints from :mod:`mopd.preflight`; fp64 oracles from
:mod:`mopd.reference`.
"""

from mopd.backends import HTTPTeacher, TeacherBackend, TokenBatch, TransformersTeacher
from mopd.config import (
    DivergenceConfig,
    MOPDConfig,
    MOPDLossConfig,
    RoutingSpec,
    TeacherPoolConfig,
    TeacherSpec,
    TeacherTreeConfig,
)
from mopd.divergences import full_vocab_divergence, topk_divergence
from mopd.errors import ConfigError, MOPDError
from mopd.objectives import TokenTargets, mopd_pg_loss
from mopd.preflight import run_preflight
from mopd.routing import score_routed, stamp_routes
from mopd.teachers import TeacherPool

_MEGATRON = ("MOPDMicroBatch", "mopd_loss_func", "build_teacher_pool", "MegatronTeacherHost")

__all__ = [
    "MOPDConfig", "MOPDLossConfig", "DivergenceConfig", "RoutingSpec", "TeacherSpec", "TeacherPoolConfig",
    "TeacherTreeConfig",
    "TeacherPool", "TeacherBackend", "TokenBatch", "HTTPTeacher", "TransformersTeacher",
    "stamp_routes", "score_routed", "TokenTargets", "mopd_pg_loss", "full_vocab_divergence", "topk_divergence",
    "run_preflight",
    "MOPDError", "ConfigError",
    *_MEGATRON,
]


def __getattr__(name):
    if name in _MEGATRON:
        from mopd import megatron

        return getattr(megatron, name)
    raise AttributeError(f"module 'mopd' has no attribute {name!r}")
