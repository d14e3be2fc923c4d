"""Shared teacher source: one teacher forward feeds several independent student runs.

See ``docs/shared_teacher.md``. Importing this package needs only torch and psutil; Megatron is
imported inside :mod:`shared_teacher.megatron` functions.
"""

from shared_teacher.admission import (
    NodeGate,
    PreflightReport,
    admission_capacity,
    cross_node_skew,
    need_samples,
    node_epoch_sizes,
    preflight,
)
from shared_teacher.client import StudentReader, Window, run_producer
from shared_teacher.config import SIGNALS, CompatKey, NodeLimits, SourceConfig, StudentSpec
from shared_teacher.errors import (
    AdmissionConfigError,
    CrossNodeSkewError,
    IncompatibleSubscriptionError,
    LeaseExpiredError,
    PublishError,
    SharedTeacherError,
    SourceClosedError,
    SourceConfigError,
    SourceStalledError,
    SourceTeardownBlockedError,
    StaleRefError,
    StoreError,
    WaitTimeoutError,
)
from shared_teacher.features import TeacherFeatureFn, features_from_logits, fingerprint_state_dict
from shared_teacher.ledger import StudentCursor
from shared_teacher.megatron import (
    MegatronTeacher,
    collate,
    export_hf_state_dict,
    topk_distill_loss,
    train_window,
)
from shared_teacher.reference import (
    SimNode,
    SimResult,
    SimStudent,
    StateBudgetExceeded,
    simulate_node,
    simulate_nodes,
    teacher_features_reference,
)
from shared_teacher.refs import SampleRef, epoch_order, sample_id
from shared_teacher.rpc import SourceClient, SourceServer
from shared_teacher.source import SharedTeacherSource
from shared_teacher.store import FeatureStore, FileStore, ShmStore, open_store

__all__ = [
    "SIGNALS", "AdmissionConfigError", "CompatKey", "CrossNodeSkewError", "FeatureStore", "FileStore", "IncompatibleSubscriptionError",
    "LeaseExpiredError", "MegatronTeacher", "PublishError", "WaitTimeoutError", "NodeGate", "NodeLimits", "PreflightReport", "SampleRef",
    "SharedTeacherError", "SharedTeacherSource", "ShmStore", "SimNode", "SimResult", "SimStudent", "SourceClient", "SourceClosedError",
    "SourceConfig", "SourceConfigError", "SourceServer", "SourceStalledError", "SourceTeardownBlockedError",
    "StaleRefError", "StoreError", "StudentCursor", "StudentReader", "StudentSpec", "TeacherFeatureFn", "Window",
    "collate", "epoch_order", "export_hf_state_dict", "features_from_logits", "fingerprint_state_dict",
    "admission_capacity", "cross_node_skew", "need_samples", "node_epoch_sizes", "open_store", "preflight", "run_producer", "sample_id",
    "simulate_node", "simulate_nodes", "StateBudgetExceeded",
    "teacher_features_reference", "topk_distill_loss", "train_window",
]
