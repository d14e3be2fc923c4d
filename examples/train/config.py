"""Structured (Hydra) config of the real-architecture MOPD runner: kw_only dataclasses, a
docstring under every field, validation raising :class:`TrainConfigError` naming field and value.
Importing this module registers :class:`TrainConfig` in Hydra's ConfigStore as ``train_schema``."""

from __future__ import annotations

from dataclasses import dataclass, field

from harts.config import AttentionBackend
from mcore_distill.errors import ConfigError, ConfigTypeError
from mcore_distill.validate import validate_fields

__all__ = ["ArchConfig", "WorkloadConfig", "RunConfig", "TrainConfig", "TrainConfigError", "register_schema",
           "to_train_config"]

_DTYPES = ("float32", "bfloat16", "float64")


class TrainConfigError(ConfigError):
    """A field of the runner config holds an invalid value (the message names field and value)."""


class TrainConfigTypeError(TrainConfigError, ConfigTypeError):
    """A config field holds a value of the wrong type (the message names the field and the value)."""


def _fields(obj: object) -> None:
    validate_fields(obj, error=TrainConfigError, type_error=TrainConfigTypeError)


def _check(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise TrainConfigError(f"{name}={value!r}: {why}")


@dataclass(kw_only=True)
class ArchConfig:
    """A Qwen3-family architecture built as a Megatron-Core ``GPTModel`` (local layer spec, random init).

    Dense and MoE models are Qwen3 stacks (RMSNorm, SwiGLU, GQA, RoPE, qk-norm). A ``layer_pattern``
    of ``G``/``A`` letters builds a hybrid stack (``harts.gdn_megatron.hybrid_block_spec``): ``G`` a
    Gated DeltaNet mixer, ``A`` softmax attention, each followed by a dense SwiGLU MLP."""

    name: str = "tiny_dense"
    """Label printed with the results."""
    vocab_size: int = 512
    """Vocabulary size V (Qwen3 tokenizers: 151936)."""
    hidden_size: int = 64
    """Model width H."""
    num_layers: int = 2
    """Transformer layers."""
    num_attention_heads: int = 4
    """Query heads of the softmax-attention layers."""
    num_query_groups: int = 2
    """Key/value heads (GQA); must divide ``num_attention_heads``."""
    kv_channels: int | None = None
    """Head dim (Qwen3: 128); ``hidden_size // num_attention_heads`` when null."""
    ffn_hidden_size: int = 128
    """SwiGLU intermediate size of dense MLPs."""
    rotary_base: int = 1000000
    """RoPE theta (Qwen3: 1e6)."""
    tie_embeddings: bool = False
    """Share input embedding and LM head (Qwen3-0.6B / 1.7B: true)."""
    max_sequence_length: int = 4096
    """Longest sequence (RoPE table size)."""
    num_moe_experts: int | None = None
    """Routed experts per MoE layer; null for dense MLPs."""
    moe_router_topk: int = 8
    """Experts per token (Qwen3-MoE: 8)."""
    moe_ffn_hidden_size: int | None = None
    """Intermediate size of one expert (Qwen3-30B-A3B: 768)."""
    layer_pattern: str | None = None
    """One letter per layer, ``G`` (Gated DeltaNet) or ``A`` (attention); null: all attention."""
    linear_conv_kernel_dim: int = 4
    """GDN short-convolution width."""
    linear_key_head_dim: int = 128
    """GDN key head dim."""
    linear_value_head_dim: int = 128
    """GDN value head dim."""
    linear_num_key_heads: int = 16
    """GDN key heads."""
    linear_num_value_heads: int = 32
    """GDN value heads (a multiple of the key heads)."""
    params_dtype: str = "bfloat16"
    """Parameter dtype: ``bfloat16`` (GPU; Float16Module wrapper), ``float32`` or ``float64``."""
    recompute: bool = False
    """Full activation recomputation of every layer."""
    hf_path: str | None = None
    """Start the student from this HF folder (``config.json`` + safetensors, e.g. written by
    ``mcore_distill.hf.save_hf_checkpoint``) with ``mcore_distill.hf.megatron_model_from_hf``; the
    shape fields above are then read from its ``config.json`` (``params_dtype`` and ``recompute``
    still apply)."""
    teacher_hf_path: str | None = None
    """The teacher's HF folder (same architecture as ``hf_path``); null: the teacher loads
    ``hf_path`` too (both start equal), or is randomly initialised when ``hf_path`` is null."""

    def __post_init__(self) -> None:
        _fields(self)

    def validate(self, name: str = "model") -> None:
        _check(self.teacher_hf_path is None or self.hf_path is not None, f"{name}.teacher_hf_path",
               self.teacher_hf_path, f"needs {name}.hf_path (the student's folder) as well")
        for f in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
                  "ffn_hidden_size", "max_sequence_length", "moe_router_topk"):
            _check(getattr(self, f) >= 1, f"{name}.{f}", getattr(self, f), "must be >= 1")
        _check(self.num_attention_heads % self.num_query_groups == 0, f"{name}.num_query_groups",
               self.num_query_groups, f"must divide num_attention_heads={self.num_attention_heads}")
        if self.kv_channels is None:
            _check(self.hidden_size % self.num_attention_heads == 0, f"{name}.hidden_size", self.hidden_size,
                   f"must be divisible by num_attention_heads={self.num_attention_heads} when kv_channels is null")
        _check(self.params_dtype in _DTYPES, f"{name}.params_dtype", self.params_dtype, f"one of {'|'.join(_DTYPES)}")
        if self.num_moe_experts is not None:
            _check(self.num_moe_experts >= 1, f"{name}.num_moe_experts", self.num_moe_experts, "must be >= 1 or null")
            _check(self.moe_router_topk <= self.num_moe_experts, f"{name}.moe_router_topk", self.moe_router_topk,
                   f"must be <= num_moe_experts={self.num_moe_experts}")
        if self.layer_pattern is not None:
            p = self.layer_pattern
            _check(len(p) == self.num_layers and set(p) <= {"G", "A"}, f"{name}.layer_pattern", p,
                   f"needs one letter G/A per layer (num_layers={self.num_layers})")
            _check(self.num_moe_experts is None, f"{name}.num_moe_experts", self.num_moe_experts,
                   "hybrid stacks (layer_pattern) use dense MLPs here; set it to null")
            _check(self.linear_num_value_heads % self.linear_num_key_heads == 0, f"{name}.linear_num_value_heads",
                   self.linear_num_value_heads, f"must be a multiple of linear_num_key_heads={self.linear_num_key_heads}")

    @property
    def hybrid(self) -> bool:
        return self.layer_pattern is not None and "G" in self.layer_pattern


@dataclass(kw_only=True)
class WorkloadConfig:
    """Rollouts per step: ``grpo`` synthetic GRPO groups (``harts.workload.grpo_groups``: shared prompts,
    random response tokens) or ``agent`` multi-turn airline tool-use episodes (``examples.agent``)."""

    kind: str = "grpo"
    """``grpo`` or ``agent`` (then the prompt/response lengths are unused: episodes set them)."""
    num_groups: int = 4
    """Prompts (``agent``: tasks) per step; one prefix tree each."""
    group_size: int = 8
    """Responses (``agent``: episodes) per prompt n."""
    prompt_len: int = 64
    """Prompt tokens P (shared by the group: packed once)."""
    response_len: int = 64
    """Response tokens R (the loss covers them)."""
    response_jitter: int = 0
    """Response lengths drawn from ``[R - jitter, R + jitter]``."""
    agent_p_error: float = 0.2
    """``agent``: probability that the scripted policy takes a wrong action at a step."""

    def __post_init__(self) -> None:
        _fields(self)

    def validate(self, name: str = "workload") -> None:
        _check(self.kind in ("grpo", "agent"), f"{name}.kind", self.kind, "one of grpo|agent")
        _check(0.0 <= self.agent_p_error <= 1.0, f"{name}.agent_p_error", self.agent_p_error, "must be in [0, 1]")
        for f in ("num_groups", "group_size", "prompt_len", "response_len"):
            _check(getattr(self, f) >= 1, f"{name}.{f}", getattr(self, f), "must be >= 1")
        _check(0 <= self.response_jitter < self.response_len, f"{name}.response_jitter", self.response_jitter,
               f"must be in [0, response_len={self.response_len})")


@dataclass(kw_only=True)
class RunConfig:
    """Steps, optimizer, loss and execution options."""

    steps: int = 4
    """MOPD steps (the first is warm-up: compilation, allocator; excluded from the averages)."""
    lr: float = 1e-5
    """AdamW learning rate (constant)."""
    residency: str = "staged"
    """``staged``: StagedAdamW (master weights and moments in host slabs); ``gpu``: Megatron's own."""
    slot_numel: int = 16777216
    """Elements per staged-optimizer device slot."""
    is_cap: float = 5.0
    """Truncated importance-weight cap of the MOPD loss."""
    adv_clip: float = 3.0
    """Per-token advantage clip of the MOPD loss."""
    temperature: float = 1.0
    """Scoring temperature of student and teacher."""
    attention_backend: str = "auto"
    """harts tree attention: ``flex`` / ``varlen`` (CUDA), ``dense`` (CPU); ``auto`` picks flex on CUDA."""
    head_chunk_size: int = 4096
    """Rows per chunk of the tree LM head (bounds the [chunk, V] logits)."""
    device: str = "auto"
    """``cuda``, ``cpu`` or ``auto`` (CUDA when available)."""
    seed: int = 0
    """Seed of the model init (teacher: seed + 1) and the workload."""
    memory_margin: float = 0.9
    """Refuse to start when the estimated resident bytes exceed this share of free device memory."""

    def __post_init__(self) -> None:
        _fields(self)

    def validate(self, name: str = "run") -> None:
        _check(self.steps >= 1, f"{name}.steps", self.steps, "must be >= 1")
        _check(self.lr > 0, f"{name}.lr", self.lr, "must be > 0")
        _check(self.temperature > 0, f"{name}.temperature", self.temperature, "must be > 0")
        _check(self.residency in ("staged", "gpu"), f"{name}.residency", self.residency, "one of staged|gpu")
        _check(self.attention_backend in ["auto", *AttentionBackend], f"{name}.attention_backend",
               self.attention_backend, f"one of auto|{'|'.join(AttentionBackend)}")
        _check(self.device in ("auto", "cuda", "cpu"), f"{name}.device", self.device, "one of auto|cuda|cpu")
        _check(self.slot_numel >= 1, f"{name}.slot_numel", self.slot_numel, "must be >= 1")
        _check(self.head_chunk_size >= 1, f"{name}.head_chunk_size", self.head_chunk_size, "must be >= 1")
        _check(0 < self.memory_margin <= 1, f"{name}.memory_margin", self.memory_margin, "must be in (0, 1]")


@dataclass(kw_only=True)
class TrainConfig:
    """The whole runner: a student and a frozen teacher of the same architecture (separate random
    inits), a workload, and run options."""

    model: ArchConfig = field(default_factory=ArchConfig)
    """Architecture (Hydra group ``model``: ``examples/configs/model/*.yaml``)."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """Rollout shape."""
    run: RunConfig = field(default_factory=RunConfig)
    """Steps and execution."""
    out_json: str | None = None
    """Write the results as JSON here (null: print only)."""

    def __post_init__(self) -> None:
        _fields(self)

    def validate(self) -> None:
        self.model.validate("model")
        self.workload.validate("workload")
        self.run.validate("run")
        if self.workload.kind == "agent":
            _check(self.model.vocab_size >= 135, "model.vocab_size", self.model.vocab_size,
                   "the agent workload's tokenizer (examples.agent.ToyTokenizer) needs >= 135 ids")
            return
        need = self.workload.prompt_len + self.workload.response_len + self.workload.response_jitter
        _check(need <= self.model.max_sequence_length, "model.max_sequence_length", self.model.max_sequence_length,
               f"shorter than prompt_len + response_len + jitter = {need}")


def register_schema() -> None:
    """Store :class:`TrainConfig` in Hydra's ConfigStore as ``train_schema`` (the first entry of
    ``examples/configs/train.yaml``'s defaults list; idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def to_train_config(dcfg) -> TrainConfig:
    """A composed Hydra config as a validated :class:`TrainConfig`. Keys added with ``+key=...``
    pass Hydra's composition; they are refused here by name with the valid keys
    (:class:`TrainConfigError`)."""
    from mcore_distill.structured import to_dataclass

    cfg = to_dataclass(dcfg, TrainConfig, error=TrainConfigError)
    cfg.validate()
    return cfg


register_schema()
