"""Typed, validated configs for colocation (usable as Hydra structured configs).

Choice fields are plain ``str`` (OmegaConf 2.3 has no ``Literal``); the allowed values are
listed in each docstring and checked in ``__post_init__``. Every bad value raises
:class:`~colocate.errors.ConfigError` (a ``ValueError``) naming the field and the value.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from colocate.errors import ConfigError, ConfigTypeError
from mcore_distill.validate import validate_fields

__all__ = ["ConfigError", "ConfigTypeError", "HFModelSpec", "PublishConfig", "EngineConfig", "WorkerSpec",
           "SGLangServerConfig", "Transport", "Verify"]

MiB = 1 << 20


class Transport(enum.StrEnum):
    """How the publisher moves buckets (see :attr:`PublishConfig.transport`)."""

    auto = "auto"
    inprocess = "inprocess"
    shm = "shm"
    cuda_ipc = "cuda_ipc"
    disk = "disk"


class Verify(enum.StrEnum):
    """What the publisher checks after a publish (see :attr:`PublishConfig.verify`)."""

    checksum = "checksum"
    sampled = "sampled"
    none = "none"


def _validate(obj: object) -> None:
    validate_fields(obj, error=ConfigError, type_error=ConfigTypeError)


def _positive(obj: object, *names: str) -> None:
    for n in names:
        v = getattr(obj, n)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"{type(obj).__name__}.{n} must be a positive int, got {v!r}")


@dataclass(kw_only=True)
class HFModelSpec:
    """Shape of a Qwen3 / Qwen3-MoE model as the HF checkpoint (and SGLang) sees it."""

    arch: str
    """HF architecture family: ``qwen3`` (dense) or ``qwen3_moe``."""
    num_layers: int
    """Transformer layers of the whole model (all pipeline stages)."""
    hidden_size: int
    """Model width H."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups); divides ``num_attention_heads``."""
    head_dim: int
    """Per-head channels (Megatron ``kv_channels``)."""
    ffn_hidden_size: int
    """Dense MLP intermediate size (per gate/up half)."""
    vocab_size: int
    """Rows of the embedding / LM head as trained (Megatron pads the vocab, e.g. to 128·TP)."""
    serve_vocab_size: int | None = None
    """Rows the receiver holds, when its checkpoint has the unpadded vocab (e.g. 151936 for
    Qwen3 trained with a padded 152064); the extra trained rows are not sent. None: same."""
    tie_embeddings: bool = False
    """LM head shares the embedding; no ``lm_head.weight`` is sent."""
    num_experts: int | None = None
    """Routed experts per MoE layer; None for a dense model."""
    moe_ffn_hidden_size: int | None = None
    """Expert intermediate size; defaults to ``ffn_hidden_size``."""
    router_dtype: str | None = None
    """Dtype the router (``mlp.gate.weight``) is sent in: ``fp32``, ``bf16``, ``fp16``; None keeps
    the training dtype."""
    has_expert_bias: bool = False
    """The router carries an aux-loss-free ``expert_bias`` (sent fp32 as ``e_score_correction_bias``)."""
    num_experts_per_tok: int = 2
    """Router top-k (receiver config only)."""
    rope_theta: float = 1_000_000.0
    """RoPE base (Megatron ``rotary_base``; receiver config only)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (Megatron ``layernorm_epsilon``; receiver config only)."""
    max_position_embeddings: int = 4096
    """Longest sequence the receiver is configured for."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.arch not in ("qwen3", "qwen3_moe"):
            raise ConfigError(f"HFModelSpec.arch must be 'qwen3' or 'qwen3_moe', got {self.arch!r}")
        _positive(self, "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "head_dim",
                  "ffn_hidden_size", "vocab_size")
        if self.num_attention_heads % self.num_query_groups:
            raise ConfigError(f"HFModelSpec.num_query_groups={self.num_query_groups} must divide "
                              f"num_attention_heads={self.num_attention_heads}")
        if (self.arch == "qwen3_moe") != bool(self.num_experts):
            raise ConfigError(f"HFModelSpec.num_experts={self.num_experts!r} does not fit arch={self.arch!r} "
                              "(qwen3_moe needs experts, qwen3 none)")
        if self.num_experts is not None:
            _positive(self, "num_experts")
        if self.serve_vocab_size is not None and not 0 < self.serve_vocab_size <= self.vocab_size:
            raise ConfigError(f"HFModelSpec.serve_vocab_size={self.serve_vocab_size!r} must be in "
                              f"(0, vocab_size={self.vocab_size}]")
        if self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if self.router_dtype not in (None, "fp32", "bf16", "fp16"):
            raise ConfigError(f"HFModelSpec.router_dtype must be None, 'fp32', 'bf16' or 'fp16', got {self.router_dtype!r}")


@dataclass(kw_only=True)
class PublishConfig:
    """How the publisher moves converted weights to a receiver."""

    transport: Transport = Transport.auto
    """``auto``, ``inprocess``, ``shm``, ``cuda_ipc`` or ``disk``; ``auto`` takes the first one the receiver's capabilities accept, in the order
    inprocess, cuda_ipc, shm, disk."""
    bucket_bytes: int = 512 * MiB
    """Target bytes per flattened bucket (512 MiB–1 GiB on GPU; smaller values are for tests)."""
    max_in_flight: int = 2
    """Buckets handed to the receiver and not yet acknowledged (1 or 2)."""
    verify: Verify = Verify.checksum
    """``checksum``, ``sampled`` or ``none``. After publish: full checksum of every tensor read back, a sampled comparison, or nothing."""
    sample_count: int = 64
    """Elements compared per tensor in ``sampled`` mode."""
    timeout_s: float = 600.0
    """Upper bound on each wait of a publish for a receiver in another process (specs,
    ``begin_update``, every acknowledgement, the load and commit in ``end_update``, the
    read-back, abort and unmapping), whatever the proxy's own default. An in-process receiver is
    called directly; its own timeouts apply (an SGLang HTTP client's ``timeout_s``)."""
    disk_dir: str | None = None
    """Folder for the disk transport; a fresh temp folder when None."""

    def __post_init__(self) -> None:
        _validate(self)
        _positive(self, "bucket_bytes", "sample_count")
        if self.max_in_flight not in (1, 2):
            raise ConfigError(f"PublishConfig.max_in_flight must be 1 or 2, got {self.max_in_flight!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"PublishConfig.timeout_s must be > 0, got {self.timeout_s!r}")


@dataclass(kw_only=True)
class EngineConfig:
    """The embedded ``transformers`` rollout engine."""

    device: str = "cpu"
    """Torch device the engine's model lives on (``cpu`` or ``cuda[:i]``)."""
    dtype: str = "float32"
    """Parameter and compute dtype: ``float32``, ``float64``, ``bfloat16`` or ``float16``."""
    max_new_tokens: int = 16
    """Default generation length."""
    temperature: float = 1.0
    """Default sampling temperature; 0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens before sampling (0 = off)."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.dtype not in ("float32", "float64", "bfloat16", "float16"):
            raise ConfigError(f"EngineConfig.dtype: unsupported dtype {self.dtype!r}")
        _positive(self, "max_new_tokens")
        if self.temperature < 0:
            raise ConfigError(f"EngineConfig.temperature must be >= 0, got {self.temperature!r}")
        if self.top_k < 0:
            raise ConfigError(f"EngineConfig.top_k must be >= 0, got {self.top_k!r}")


@dataclass(kw_only=True)
class WorkerSpec:
    """A colocated role forked from its owner (same node, same physical GPUs)."""

    role: str
    """Name of the role, e.g. ``rollout`` or ``teacher``."""
    command: list[str]
    """argv of the worker process."""
    env: dict[str, str] = field(default_factory=dict)
    """Per-role overrides merged over the owner's environment (a value of ``""`` removes the key)."""
    scheduler: str | None = None
    """The scheduler that must start it: ``local`` (a subprocess), ``slurm`` (a step in the
    owner's job) or ``ray`` (an actor on the owner's node); a scheduler of another kind refuses
    the spec (:class:`~colocate.errors.WorkerError`), and :func:`colocate.workers.scheduler_for`
    builds the one named. None: any scheduler may start it."""
    devices: list[int] | None = None
    """The owner's logical GPU indices this worker gets (mapped to physical ids through the
    owner's ``CUDA_VISIBLE_DEVICES``); None gives it all of the owner's devices."""
    health_timeout_s: float = 60.0
    """How long ``start`` waits for the worker's ready line."""
    kill_grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when stopping."""
    log_path: str | None = None
    """File that receives the worker's stdout and stderr (appended); None: the owner's."""

    def __post_init__(self) -> None:
        _validate(self)
        if not self.role or not self.role.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"WorkerSpec.role must be a non-empty identifier, got {self.role!r}")
        if not self.command or not all(isinstance(a, str) for a in self.command):
            raise ConfigError(f"WorkerSpec.command must be a non-empty list of str, got {self.command!r}")
        if self.scheduler not in (None, "local", "slurm", "ray"):
            raise ConfigError(f"WorkerSpec.scheduler must be None, 'local', 'slurm' or 'ray', got {self.scheduler!r}")
        if self.devices is not None and (not self.devices or any(not isinstance(d, int) or d < 0 for d in self.devices)):
            raise ConfigError(f"WorkerSpec.devices must be None or non-negative ints, got {self.devices!r}")
        bad = {k: v for k, v in self.env.items() if not isinstance(k, str) or not isinstance(v, str)}
        if bad:
            raise ConfigError(f"WorkerSpec.env must map str to str, bad entries: {bad!r}")
        if not self.health_timeout_s > 0:
            raise ConfigError(f"WorkerSpec.health_timeout_s must be > 0, got {self.health_timeout_s!r}")
        if not self.kill_grace_s >= 0:
            raise ConfigError(f"WorkerSpec.kill_grace_s must be >= 0, got {self.kill_grace_s!r}")


@dataclass(kw_only=True)
class SGLangServerConfig:
    """One ``sglang.launch_server`` started as a colocated worker of the trainer
    (:meth:`colocate.SGLangEngine.launch_server`): its server arguments and its role's
    environment (:meth:`role_env`), e.g. a rollout engine beside the trainer, or a teacher of
    another size that mopd's :class:`~mopd.backends.HTTPTeacher` scores against."""

    model_path: str
    """HF checkpoint folder the server loads (``config.json`` + safetensors)."""
    role: str = "rollout"
    """Worker role name (``COLOCATE_ROLE`` in the server's environment), e.g. ``rollout``, ``teacher``."""
    port: int = 0
    """TCP port on 127.0.0.1; 0 picks a free one."""
    tp_size: int = 1
    """SGLang tensor-parallel size."""
    devices: list[int] | None = None
    """The owner's logical GPUs the server gets (see :func:`colocate.sglang_clients.engine_devices`); None: all."""
    mem_fraction_static: float = 0.3
    """SGLang's static memory fraction (weights + KV pool) of the GPU."""
    max_total_tokens: int = 65536
    """Token slots of the KV pool."""
    cuda_graph: bool = True
    """Capture decode CUDA graphs (batch sizes 1, 2, 4)."""
    memory_saver: bool = True
    """Start with SGLang's memory saver, so ``kv_cache`` / ``weights`` / ``cuda_graph`` can be released."""
    alloc_conf: str | None = None
    """The server's ``PYTORCH_CUDA_ALLOC_CONF`` (the owner's value and ``PYTORCH_ALLOC_CONF`` are
    removed); None: unset. ``expandable_segments:True`` is refused with ``memory_saver``: it
    silently disables SGLang's memory saver."""
    env: dict[str, str] = field(default_factory=dict)
    """Further role overrides merged over the owner's environment (``""`` removes a variable)."""
    start_timeout_s: float = 300.0
    """Deadline for ``GET /health`` to answer 200 after the start (a fresh box builds kernels first)."""
    request_timeout_s: float = 600.0
    """Deadline of every request to the server (:class:`~colocate.sglang_clients.HTTPClient`)."""
    log_path: str | None = None
    """File that receives the server's output; None: the owner's."""

    def __post_init__(self) -> None:
        _validate(self)
        if not self.model_path:
            raise ConfigError("SGLangServerConfig.model_path must name an HF checkpoint folder, got ''")
        if not self.role or not self.role.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"SGLangServerConfig.role must be a non-empty identifier, got {self.role!r}")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"SGLangServerConfig.port must be in [0, 65535], got {self.port!r}")
        _positive(self, "tp_size", "max_total_tokens")
        if not 0 < self.mem_fraction_static < 1:
            raise ConfigError(f"SGLangServerConfig.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static!r}")
        if self.memory_saver and self.alloc_conf and "expandable_segments:true" in self.alloc_conf.replace(" ", "").lower():
            raise ConfigError(f"SGLangServerConfig.alloc_conf={self.alloc_conf!r} with memory_saver=True: expandable "
                              "segments silently disable SGLang's memory saver (set memory_saver=False or drop them)")
        for n in ("start_timeout_s", "request_timeout_s"):
            if not getattr(self, n) > 0:
                raise ConfigError(f"SGLangServerConfig.{n} must be > 0, got {getattr(self, n)!r}")

    def role_env(self) -> dict[str, str | None]:
        """The role's environment overrides (None removes a variable): the allocator settings
        (``PYTORCH_CUDA_ALLOC_CONF`` = :attr:`alloc_conf`, ``PYTORCH_ALLOC_CONF`` removed),
        ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` when graphs are captured under the memory saver (it
        must be set before capture, or ``cuda_graph`` cannot be released), ``HF_HUB_OFFLINE=1``
        (nothing is downloaded), then :attr:`env`. The launch applies them over the owner's
        environment less its torchrun variables
        (:func:`colocate.sglang_clients.sglang_env_overrides`)."""
        out: dict[str, str | None] = {"PYTORCH_CUDA_ALLOC_CONF": self.alloc_conf or None, "PYTORCH_ALLOC_CONF": None,
                                      "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1" if self.cuda_graph and self.memory_saver
                                      else None, "HF_HUB_OFFLINE": "1"}
        out.update({k: (v or None) for k, v in self.env.items()})
        return out
