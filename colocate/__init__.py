"""colocate: residency, Megatron → HF/SGLang weight publication, forked colocated workers."""

from colocate.buckets import Entry, pack_bucket, plan_buckets, tensor_checksum, unpack_bucket
from colocate.config import ConfigError, EngineConfig, HFModelSpec, PublishConfig, WorkerSpec
from colocate.convert import (
    ConversionError,
    ParamMismatchError,
    check_params,
    globalize_name,
    hf_param_specs,
    megatron_to_hf,
    merge_qkv,
    merge_tp_shards,
    split_qkv,
)
from colocate.reference import reference_merge_glu, reference_split_qkv, reference_tensor_checksum
from colocate.residency import (
    ENGINE_TAGS,
    TRAINER_TAGS,
    BusyError,
    NotResidentError,
    Residency,
    ResidencyError,
    ResidencyEvent,
    TensorOffload,
)

__all__ = [
    "ENGINE_TAGS", "TRAINER_TAGS", "BusyError", "ConfigError", "ConversionError", "EngineConfig", "Entry",
    "HFModelSpec", "NotResidentError", "ParamMismatchError", "PublishConfig", "Residency", "ResidencyError",
    "ResidencyEvent", "TensorOffload", "WorkerSpec", "check_params", "globalize_name", "hf_param_specs",
    "megatron_to_hf", "merge_qkv", "merge_tp_shards", "pack_bucket", "plan_buckets", "reference_merge_glu",
    "reference_split_qkv", "reference_tensor_checksum", "split_qkv", "tensor_checksum", "unpack_bucket",
]
