"""Structured (Hydra) config of the demo: kw_only dataclasses, a docstring under every field.

Importing this module registers :class:`DemoConfig` in Hydra's ConfigStore as ``demo_schema``
(the first entry of ``conf/demo.yaml``'s defaults list), so Hydra's compose API works::

    from hydra import compose, initialize_config_dir
    from examples.demo.config import to_demo_config

    with initialize_config_dir(config_dir=".../examples/demo/conf", version_base="1.3"):
        cfg = to_demo_config(compose(config_name="demo", overrides=["mopd.steps=10"]))
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harts.config import AttentionBackend
from mcore_distill.errors import ConfigError, ConfigTypeError
from mcore_distill.validate import validate_fields


class DemoConfigError(ConfigError):
    """A demo config field holds an invalid value (the message names the field and the value)."""


class DemoConfigTypeError(DemoConfigError, ConfigTypeError):
    """A config field holds a value of the wrong type (the message names the field and the value)."""


def _fields(obj: object) -> None:
    validate_fields(obj, error=DemoConfigError, type_error=DemoConfigTypeError)


def _check(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise DemoConfigError(f"{name}={value!r}: {why}")


@dataclass(kw_only=True)
class ModelConfig:
    """Shape of a tiny Qwen3-style Megatron GPT (``mcore_distill.testing.TinyGPTConfig``)."""

    hidden_size: int = 128
    """Model width H."""
    num_layers: int = 2
    """Transformer layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA)."""
    ffn_hidden_size: int = 256
    """SwiGLU intermediate size."""

    def __post_init__(self) -> None:
        _fields(self)

    def validate(self, name: str) -> None:
        for f in ("hidden_size", "num_layers", "num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            _check(getattr(self, f) >= 1, f"{name}.{f}", getattr(self, f), "must be >= 1")
        _check(self.hidden_size % self.num_attention_heads == 0, f"{name}.hidden_size", self.hidden_size,
               f"must be divisible by num_attention_heads={self.num_attention_heads}")
        _check(self.num_attention_heads % self.num_query_groups == 0, f"{name}.num_query_groups",
               self.num_query_groups, f"must divide num_attention_heads={self.num_attention_heads}")


@dataclass(kw_only=True)
class TeacherTrainConfig:
    """Supervised training of each teacher on its own domain (cosine-decayed LR)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Teacher architecture (both teachers share it, so one resident Megatron host serves both)."""
    steps: int = 300
    """Optimizer steps per teacher."""
    batch: int = 32
    """Sequences per rank per step."""
    lr: float = 3e-3
    """Peak learning rate (cosine decay to ``lr * min_lr_ratio``)."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of ``lr``."""
    min_accuracy: float = 0.9
    """A teacher below this held-out exact-match accuracy stops the demo with an error."""
    distill_prompts: int = 2048
    """Prompts per domain whose greedy teacher answers form the warm-start (sequence-level KD) set."""
    http_routes: list[str] = field(default_factory=lambda: ["shift"])
    """Domains whose teacher is served over HTTP by a child server (``teacher_server``) instead of
    the resident Megatron host; those teachers have the architecture ``http_model``."""
    http_model: ModelConfig = field(default_factory=lambda: ModelConfig(hidden_size=96, ffn_hidden_size=192))
    """Architecture of the HTTP-served teachers (another size than ``model``)."""

    def __post_init__(self) -> None:
        _fields(self)


@dataclass(kw_only=True)
class WarmStartConfig:
    """Sequence-level distillation of the student on teacher outputs, before MOPD."""

    steps: int = 150
    """Optimizer steps (0 skips the warm start)."""
    batch: int = 32
    """Sequences per rank per step (half of each domain)."""
    lr: float = 3e-3
    """Learning rate (constant)."""
    mix: dict[str, float] = field(default_factory=lambda: {"reverse": 0.7, "shift": 0.3})
    """Share of each domain in a warm-start batch (normalized; every domain must be listed)."""

    def __post_init__(self) -> None:
        _fields(self)


@dataclass(kw_only=True)
class MOPDStageConfig:
    """The on-policy phase: rollouts, tree packing, routed teachers, MOPD loss, publish."""

    steps: int = 250
    """Optimizer steps."""
    prompts_per_step: int = 4
    """Prompts per rank per step (alternating domains)."""
    group_size: int = 8
    """Samples per prompt (a GRPO group; the prompt is shared in the tree)."""
    temperature: float = 1.0
    """Rollout and scoring temperature."""
    lr: float = 5e-4
    """Peak learning rate (cosine decay to 10%)."""
    is_cap: float = 5.0
    """Truncated importance-weight cap (``MOPDLossConfig.is_cap``)."""
    adv_clip: float = 3.0
    """Per-token advantage clip (``MOPDLossConfig.adv_clip``)."""
    forward: str = "tree"
    """``tree`` (harts: shared prompts packed once, tree attention) or ``plain`` ([B, S] batch)."""
    attention_backend: str = "dense"
    """harts attention backend: ``dense`` on CPU; ``flex`` or ``varlen`` on CUDA."""
    eval_every: int = 25
    """Held-out evaluation period in steps (and at the last step)."""

    def __post_init__(self) -> None:
        _fields(self)


@dataclass(kw_only=True)
class WorkloadSection:
    """What the engine rolls out each MOPD step (:mod:`examples.demo.workload`); the phases, the
    loss and the logging are the same for every kind, only the rows and the loss mask differ."""

    kind: str = "grpo"
    """``grpo``: a group of ``mopd.group_size`` single answers per prompt. ``agent``: multi-turn
    episodes: the model answers, the environment appends which positions were wrong
    (``OBS f_1..f_L SEP``), the model answers again (``turns`` times); observation tokens are
    masked out of the loss. The teachers and the warm start then learn that format too."""
    turns: int = 2
    """Model turns per agent episode (``agent`` only)."""
    p_wrong: float = 0.5
    """``agent``: share of non-final turns answered wrong in the supervised episodes the teachers
    and the warm start learn from (so they see observations with WRONG positions)."""

    def __post_init__(self) -> None:
        _fields(self)


@dataclass(kw_only=True)
class EngineSection:
    """The rollout engine the runner colocates with the trainer (one code path, chosen here)."""

    kind: str = "hf"
    """``hf``: the embedded ``colocate.HFEngine`` (CPU, CI); ``sglang``: an in-process
    ``sglang.Engine`` through ``colocate.SGLangEngine.launch`` (GPU)."""
    dtype: str = "float32"
    """Engine weight dtype (``float32`` / ``bfloat16``); the publisher sends this dtype."""
    mem_fraction_static: float = 0.1
    """SGLang: share of GPU memory for weights + KV pool."""
    max_total_tokens: int | None = 16384
    """SGLang: KV pool size in tokens (None: SGLang sizes it from ``mem_fraction_static``)."""
    cuda_graph: bool = False
    """SGLang: capture decode CUDA graphs (batch sizes 1, 2, 4); needs ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` in ``env``."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment set before the engine starts (SGLang reads e.g. ``SGLANG_MEMORY_SAVER_CUDA_GRAPH``)."""
    start_timeout_s: float = 300.0
    """SGLang: deadline of the engine's start; past it the processes it spawned are killed (``EngineStartError``)."""

    def __post_init__(self) -> None:
        _fields(self)


@dataclass(kw_only=True)
class TeacherServerSection:
    """The child server of the HTTP-served teachers (``teacher.http_routes``), one per job."""

    kind: str = "hf"
    """``hf``: ``python -m mopd.hf_server`` (CPU); ``sglang``: ``python -m sglang.launch_server`` (GPU)."""
    start_timeout_s: float = 180.0
    """Seconds to wait for its ``/health``."""
    timeout_s: float = 30.0
    """Budget of one scoring request (``HTTPTeacher.timeout_s``)."""
    max_retries: int = 1
    """Retries of a failed request before the teacher counts as down."""
    mem_fraction_static: float = 0.05
    """SGLang server: share of GPU memory."""
    env: dict[str, str] = field(default_factory=dict)
    """Per-role environment of the server process (merged over the owner's; ``""`` removes a variable)."""

    def __post_init__(self) -> None:
        _fields(self)


@dataclass(kw_only=True)
class VerifySection:
    """Checks that the engine serves what was published."""

    every: int = 25
    """Greedy check period in steps: the engine's greedy outputs on ``prompts`` fixed prompts per
    domain must equal the trainer's (Megatron) greedy outputs. The reported version is checked every step."""
    prompts: int = 8
    """Fixed verification prompts per domain (held-out rows)."""
    max_mismatch: float = 0.0
    """Largest tolerated fraction of verification prompts whose greedy outputs differ beyond a
    near-tie (0: none)."""
    tie_margin: float = 0.0
    """Nats: a row that first leaves the trainer's greedy path by taking the trainer's runner-up
    where ``log p(top-1) - log p(top-2) <= tie_margin`` counts as a near-tie, not a mismatch
    (0: exact outputs required; a bf16 engine against the fp32 trainer can flip near-ties)."""

    def __post_init__(self) -> None:
        _fields(self)


@dataclass(kw_only=True)
class DemoConfig:
    """The whole demo run."""

    length: int = 6
    """Letters per prompt (answers have the same length)."""
    letters: int = 16
    """Alphabet size."""
    shift: int = 3
    """Caesar shift of the ``shift`` domain."""
    seed: int = 0
    """Seed of everything (data, init, sampling)."""
    held_out: int = 256
    """Held-out prompts per domain (never used for training)."""
    teacher: TeacherTrainConfig = field(default_factory=TeacherTrainConfig)
    """Teacher training."""
    student: ModelConfig = field(default_factory=lambda: ModelConfig(hidden_size=64, ffn_hidden_size=128))
    """Student architecture (smaller than the teachers)."""
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    """Sequence-level warm start."""
    mopd: MOPDStageConfig = field(default_factory=MOPDStageConfig)
    """On-policy phase."""
    workload: WorkloadSection = field(default_factory=WorkloadSection)
    """What the engine rolls out per step (GRPO groups or multi-turn agent episodes)."""
    engine: EngineSection = field(default_factory=EngineSection)
    """Rollout engine."""
    teacher_server: TeacherServerSection = field(default_factory=TeacherServerSection)
    """Server of the HTTP-served teachers."""
    verify: VerifySection = field(default_factory=VerifySection)
    """Publish verification."""
    device: str = "cpu"
    """``cpu`` (gloo ranks) or ``cuda`` (one GPU per rank, NCCL)."""
    checkpoint_every: int = 50
    """Checkpoint period in MOPD steps (also after the warm start, as step 0); 0: never."""
    resume: bool = False
    """Continue from the last complete checkpoint under ``<out_dir>/checkpoints`` (teachers from the cache)."""
    out_dir: str = "outputs/demo"
    """Output folder (plot, TensorBoard, results JSON, ``steps.jsonl``, checkpoints); the teacher cache is ``<out_dir>/cache``."""
    use_cache: bool = True
    """Reuse trained teachers from the cache when the config hash matches."""
    progress: bool = True
    """Show tqdm progress bars (rank 0)."""

    def __post_init__(self) -> None:
        _fields(self)

    def validate(self) -> None:
        _check(2 <= self.length <= 16, "length", self.length, "must be in [2, 16]")
        _check(2 <= self.letters <= 24, "letters", self.letters, "must be in [2, 24] (vocab is 32)")
        _check(0 < self.shift < self.letters, "shift", self.shift, f"must be in [1, letters={self.letters})")
        _check(self.held_out >= 1, "held_out", self.held_out, "must be >= 1")
        self.teacher.model.validate("teacher.model")
        self.student.validate("student")
        for name, v in (("teacher.steps", self.teacher.steps), ("teacher.batch", self.teacher.batch),
                        ("teacher.distill_prompts", self.teacher.distill_prompts),
                        ("warm_start.batch", self.warm_start.batch), ("mopd.prompts_per_step", self.mopd.prompts_per_step),
                        ("mopd.group_size", self.mopd.group_size), ("mopd.eval_every", self.mopd.eval_every)):
            _check(v >= 1, name, v, "must be >= 1")
        for name, v in (("warm_start.steps", self.warm_start.steps), ("mopd.steps", self.mopd.steps)):
            _check(v >= 0, name, v, "must be >= 0")
        for name, v in (("teacher.lr", self.teacher.lr), ("warm_start.lr", self.warm_start.lr),
                        ("mopd.lr", self.mopd.lr), ("mopd.temperature", self.mopd.temperature)):
            _check(v > 0, name, v, "must be > 0")
        _check(set(self.warm_start.mix) == {"reverse", "shift"}, "warm_start.mix", dict(self.warm_start.mix),
               "needs exactly the keys reverse, shift")
        _check(all(v >= 0 for v in self.warm_start.mix.values()) and sum(self.warm_start.mix.values()) > 0,
               "warm_start.mix", dict(self.warm_start.mix), "shares must be >= 0 with a positive sum")
        _check(0.0 <= self.teacher.min_accuracy <= 1.0, "teacher.min_accuracy", self.teacher.min_accuracy,
               "must be in [0, 1]")
        _check(self.mopd.forward in ("tree", "plain"), "mopd.forward", self.mopd.forward, "one of tree|plain")
        _check(self.mopd.attention_backend in list(AttentionBackend), "mopd.attention_backend",
               self.mopd.attention_backend, f"one of {'|'.join(AttentionBackend)}")
        self.teacher.http_model.validate("teacher.http_model")
        _check(set(self.teacher.http_routes) <= {"reverse", "shift"} and len(set(self.teacher.http_routes)) < 2,
               "teacher.http_routes", list(self.teacher.http_routes),
               "at most one of reverse|shift (the other stays on the Megatron host)")
        _check(self.workload.kind in ("grpo", "agent"), "workload.kind", self.workload.kind, "one of grpo|agent")
        _check(1 <= self.workload.turns <= 4, "workload.turns", self.workload.turns, "must be in [1, 4]")
        _check(0.0 <= self.workload.p_wrong <= 1.0, "workload.p_wrong", self.workload.p_wrong, "must be in [0, 1]")
        _check(self.engine.kind in ("hf", "sglang"), "engine.kind", self.engine.kind, "one of hf|sglang")
        _check(self.engine.dtype in ("float32", "bfloat16"), "engine.dtype", self.engine.dtype, "one of float32|bfloat16")
        _check(0 < self.engine.mem_fraction_static < 1, "engine.mem_fraction_static", self.engine.mem_fraction_static,
               "must be in (0, 1)")
        _check(self.engine.max_total_tokens is None or self.engine.max_total_tokens > 0, "engine.max_total_tokens",
               self.engine.max_total_tokens, "must be > 0 or null")
        _check(self.teacher_server.kind in ("hf", "sglang"), "teacher_server.kind", self.teacher_server.kind,
               "one of hf|sglang")
        for name, v in (("engine.start_timeout_s", self.engine.start_timeout_s),
                        ("teacher_server.start_timeout_s", self.teacher_server.start_timeout_s),
                        ("teacher_server.timeout_s", self.teacher_server.timeout_s)):
            _check(v > 0, name, v, "must be > 0")
        _check(self.teacher_server.max_retries >= 0, "teacher_server.max_retries", self.teacher_server.max_retries,
               "must be >= 0")
        _check(self.device in ("cpu", "cuda"), "device", self.device, "one of cpu|cuda")
        _check(self.engine.kind == "hf" or self.device == "cuda", "engine.kind", self.engine.kind,
               "sglang needs device=cuda")
        _check(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every, "must be >= 0")
        _check(self.verify.every >= 1, "verify.every", self.verify.every, "must be >= 1")
        _check(1 <= self.verify.prompts <= self.held_out, "verify.prompts", self.verify.prompts,
               f"must be in [1, held_out={self.held_out}]")
        _check(0.0 <= self.verify.max_mismatch <= 1.0, "verify.max_mismatch", self.verify.max_mismatch,
               "must be in [0, 1]")
        _check(self.verify.tie_margin >= 0.0, "verify.tie_margin", self.verify.tie_margin, "must be >= 0")


SCHEMA_NAME = "demo_schema"


def register_schema() -> None:
    """Store :class:`DemoConfig` in Hydra's ConfigStore as ``demo_schema`` (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=DemoConfig)


def to_demo_config(dcfg) -> DemoConfig:
    """A composed Hydra config as a validated :class:`DemoConfig`. A key that is no field (one
    appended with ``+key=...`` passes Hydra's composition) raises :class:`DemoConfigError` naming
    it and the valid keys."""
    from mcore_distill.structured import to_dataclass

    cfg = to_dataclass(dcfg, DemoConfig, error=DemoConfigError)
    cfg.validate()
    return cfg


register_schema()
