"""colocate: residency, Megatron → HF/SGLang weight publication, forked colocated workers.

Re-exports only; ``import colocate`` needs neither CUDA nor sglang (both imported lazily).
"""

from colocate.awex_transport import (
    AwexUnavailable,
    awex_capabilities,
    bounded_reader_class,
    install_bounded_reader,
    resident_megatron_engine,
)
from colocate.buckets import Entry, pack_bucket, plan_buckets, tensor_checksum, unpack_bucket
from colocate.config import ConfigError, EngineConfig, HFModelSpec, PublishConfig, WorkerSpec
from colocate.convert import (
    ConversionError,
    ParamMismatchError,
    Qwen3HybridSpec,
    check_params,
    gdn_in_proj_split,
    gdn_in_proj_to_hf,
    gdn_tp_sections,
    globalize_name,
    hf_gated_q_proj,
    hf_param_specs,
    megatron_to_hf,
    merge_named_tp_shards,
    merge_qkv,
    merge_tp_sections,
    merge_tp_shards,
    split_qkv,
    split_qkv_gated,
)
from colocate.cycle import ColocatedCycle
from colocate.engines import (
    AsyncEngine,
    ControlTimeoutError,
    EngineDestroyedError,
    GenerateResult,
    GenerationAbortedError,
    HFEngine,
    UpdateError,
    WeightReceiver,
    build_hf_model,
    hf_checkpoint_views,
    hf_config,
    off_loop,
)
from colocate.megatron import (
    awex_megatron_engine,
    iter_hf_weights,
    megatron_residency_hooks,
    model_spec_from_megatron,
    publish_megatron,
    unwrap_model,
)
from colocate.publish import PoisonedVersionError, Publisher, PublishError, PublishReport
from colocate.receivers import TensorReceiver
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
from colocate.sglang_engine import SGLangEngine, sglang_checksum
from colocate.transports import (
    ReceiverDied,
    ReceiverTimeout,
    RemoteError,
    RemoteReceiver,
    TransportError,
    choose_transport,
    spawn_receiver,
)
from colocate.workers import (
    ForkedWorker,
    LocalScheduler,
    RayScheduler,
    RayWorker,
    SlurmScheduler,
    WorkerError,
    WorkerStartTimeout,
    ipc_key,
    mark_ready,
    merge_env,
    physical_gpu_ids,
)

__all__ = [
    "TensorReceiver",
    "AsyncEngine", "AwexUnavailable", "ControlTimeoutError", "EngineDestroyedError", "GenerationAbortedError",
    "Qwen3HybridSpec", "RayScheduler", "RayWorker", "awex_capabilities", "bounded_reader_class",
    "gdn_in_proj_split", "gdn_in_proj_to_hf", "gdn_tp_sections", "hf_gated_q_proj", "install_bounded_reader",
    "merge_named_tp_shards", "merge_tp_sections", "off_loop", "resident_megatron_engine", "split_qkv_gated",
    "ENGINE_TAGS", "TRAINER_TAGS", "BusyError", "ColocatedCycle", "ConfigError", "ConversionError", "EngineConfig",
    "Entry", "ForkedWorker", "GenerateResult", "HFEngine", "HFModelSpec", "LocalScheduler", "NotResidentError",
    "ParamMismatchError", "PoisonedVersionError", "PublishConfig", "PublishError", "PublishReport", "Publisher",
    "ReceiverDied", "ReceiverTimeout", "RemoteError", "RemoteReceiver", "Residency", "ResidencyError",
    "ResidencyEvent", "SGLangEngine", "SlurmScheduler", "TensorOffload", "TransportError", "UpdateError",
    "WeightReceiver", "WorkerError", "WorkerSpec", "WorkerStartTimeout", "awex_megatron_engine", "build_hf_model", "check_params",
    "choose_transport", "globalize_name", "hf_checkpoint_views", "hf_config", "hf_param_specs", "ipc_key",
    "iter_hf_weights", "mark_ready", "megatron_residency_hooks", "megatron_to_hf", "merge_env", "merge_qkv",
    "merge_tp_shards", "model_spec_from_megatron", "pack_bucket", "physical_gpu_ids", "plan_buckets",
    "publish_megatron", "reference_merge_glu", "reference_split_qkv", "reference_tensor_checksum",
    "sglang_checksum", "spawn_receiver", "split_qkv", "tensor_checksum", "unpack_bucket", "unwrap_model",
]
