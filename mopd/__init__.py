"""mopd: multi-teacher on-policy distillation for Megatron-Core trainers.

Pure-torch parts are imported here; the Megatron-Core integration (:mod:`mopd.megatron`) is
re-exported lazily so ``import mopd`` does not import Megatron-Core.
"""

from mopd.backends import HTTPTeacher, TeacherBackend, TokenBatch, TransformersTeacher
from mopd.config import (
    ROUTE_KEY,
    DivergenceConfig,
    MOPDConfig,
    MOPDLossConfig,
    RoutingSpec,
    TeacherPoolConfig,
    TeacherSpec,
    TeacherTreeConfig,
)
from mopd.divergences import full_vocab_divergence, topk_divergence
from mopd.errors import (
    ConfigError,
    DrainError,
    FingerprintMismatchError,
    MOPDError,
    NonFiniteInputError,
    RouteMutationError,
    RoutingError,
    TeacherBrokenError,
    TeacherServerError,
    TeacherStateError,
    TeacherTimeoutError,
)
from mopd.objectives import PGOutput, TokenTargets, compose_losses, mopd_pg_loss
from mopd.preflight import fingerprint_hf, run_preflight
from mopd.routing import (
    TargetAccumulator,
    derive,
    required_teachers,
    score_routed,
    stamp_routes,
    teacher_assignments,
    verify_routes,
)
from mopd.teachers import DrainReceipt, TeacherPool, TeacherState

_MEGATRON = ("MOPDMicroBatch", "build_teacher_pool", "MegatronTeacher", "MegatronTeacherHost", "mopd_loss_func", "save_teacher_checkpoint",
             "token_logprobs")

__all__ = [
    "ROUTE_KEY", "ConfigError", "DivergenceConfig", "DrainError", "DrainReceipt", "FingerprintMismatchError",
    "HTTPTeacher", "MOPDConfig", "MOPDError", "MOPDLossConfig", "NonFiniteInputError", "PGOutput", "RouteMutationError",
    "RoutingError", "RoutingSpec", "TargetAccumulator", "TeacherBackend", "TeacherBrokenError", "TeacherPool",
    "TeacherPoolConfig", "TeacherServerError", "TeacherSpec", "TeacherState", "TeacherTreeConfig", "TeacherStateError",
    "TeacherTimeoutError", "TokenBatch", "TokenTargets", "TransformersTeacher", "compose_losses", "derive",
    "fingerprint_hf", "full_vocab_divergence", "mopd_pg_loss", "required_teachers", "run_preflight", "score_routed",
    "stamp_routes", "teacher_assignments", "topk_divergence", "verify_routes", *_MEGATRON,
]


def __getattr__(name):
    if name in _MEGATRON:
        from mopd import megatron

        return getattr(megatron, name)
    raise AttributeError(f"module 'mopd' has no attribute {name!r}")
