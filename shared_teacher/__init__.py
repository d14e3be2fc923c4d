"""Shared teacher source: one teacher forward feeds several independent student runs.

See ``docs/shared_teacher.md``. Importing this package needs only torch and psutil; Megatron is
imported inside :mod:`shared_teacher.megatron` functions.

Exports what the three sides call: the configs and the source with its control-plane server (the
source process), ``run_producer`` with a teacher (the teacher process), ``StudentReader`` and
``train_window`` (each student rank), the feature stores, ``preflight``, and the errors a caller
catches. Everything else is imported from its module: every error from
:mod:`shared_teacher.errors`; ``SourceClient`` from :mod:`shared_teacher.rpc`; ``Window`` from
:mod:`shared_teacher.client`; admission internals (``NodeGate``, ``PreflightReport``,
``cross_node_skew``...) from :mod:`shared_teacher.admission`; ``collate``, ``topk_distill_loss``
and ``export_hf_state_dict`` from :mod:`shared_teacher.megatron`; sample refs from
:mod:`shared_teacher.refs`; ``StudentCursor`` from :mod:`shared_teacher.ledger`; the exhaustive
simulator and fp64 references from :mod:`shared_teacher.reference`.
"""

from shared_teacher.admission import preflight
from shared_teacher.client import StudentReader, run_producer
from shared_teacher.config import CompatKey, NodeLimits, SourceConfig, StudentSpec
from shared_teacher.errors import (
    IncompatibleSubscriptionError,
    SharedTeacherError,
    SourceClosedError,
    SourceConfigError,
    SourceStalledError,
    WaitTimeoutError,
)
from shared_teacher.features import (
    TeacherFeatureFn,
    features_from_logits,
    fingerprint_state_dict,
    max_object_bytes,
)
from shared_teacher.megatron import MegatronTeacher, train_window
from shared_teacher.rpc import SourceServer
from shared_teacher.source import SharedTeacherSource
from shared_teacher.store import FeatureStore, FileStore, ShmStore, open_store

__all__ = [
    "SourceConfig", "StudentSpec", "NodeLimits", "CompatKey",
    "SharedTeacherSource", "SourceServer", "StudentReader", "run_producer", "preflight",
    "FeatureStore", "ShmStore", "FileStore", "open_store",
    "TeacherFeatureFn", "MegatronTeacher", "features_from_logits", "fingerprint_state_dict", "max_object_bytes",
    "train_window",
    "SharedTeacherError", "SourceConfigError", "WaitTimeoutError", "SourceStalledError", "SourceClosedError",
    "IncompatibleSubscriptionError",
]
