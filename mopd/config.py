"""Configuration of multi-teacher on-policy distillation (Hydra structured configs).

Every dataclass is ``kw_only`` with a docstring under each field and validates itself in
``__post_init__`` (which OmegaConf runs in ``OmegaConf.to_object``), raising
:class:`~mopd.errors.ConfigError` that names the field and the value. Choices are plain ``str``
fields (OmegaConf 2.3 has no ``Literal``); the allowed values are listed in each docstring.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re
from dataclasses import dataclass

from harts.config import AttentionBackend
from mcore_distill.validate import check_number, validate_fields
from mopd.errors import ConfigError, ConfigTypeError

__all__ = [
    "Aggregation",
    "Divergence",
    "TopKTail",
    "TeacherBackend",
    "AGGREGATIONS",
    "DIVERGENCES",
    "RESERVED_TEACHER_IDS",
    "ROUTE_KEY",
    "DivergenceConfig",
    "MOPDConfig",
    "MOPDLossConfig",
    "RoutingSpec",
    "TeacherPoolConfig",
    "TeacherSpec",
    "TeacherTreeConfig",
    "check_teacher_id",
]



class Aggregation(enum.StrEnum):
    """How teachers combine per token (see :attr:`MOPDLossConfig.aggregation`)."""

    geometric = "geometric"
    arithmetic = "arithmetic"
    mean = "mean"


class Divergence(enum.StrEnum):
    """Full-vocabulary divergence (see :attr:`DivergenceConfig.kind`)."""

    forward_kl = "forward_kl"
    reverse_kl = "reverse_kl"
    jsd = "jsd"


class TopKTail(enum.StrEnum):
    """Treatment of the mass outside the top-k ids (see :attr:`DivergenceConfig.top_k_tail`)."""

    bucket = "bucket"
    renorm = "renorm"


class TeacherBackend(enum.StrEnum):
    """Where a teacher runs (see :attr:`TeacherSpec.backend`)."""

    megatron = "megatron"
    http = "http"


AGGREGATIONS = tuple(Aggregation)
DIVERGENCES = tuple(Divergence)
TOPK_TAILS = tuple(TopKTail)
BACKENDS = tuple(TeacherBackend)
RESERVED_TEACHER_IDS = frozenset({"actor", "student", "rl"})
ROUTE_KEY = "mopd_route"
"""Reserved sample key holding the stamped route (a ``str``)."""

_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def _validate(obj: object, **kw) -> None:
    validate_fields(obj, error=ConfigError, type_error=ConfigTypeError, **kw)


def _finite(name: str, value: float, *, positive: bool = False, nonneg: bool = False) -> None:
    check_number(name, value, positive=positive, nonneg=nonneg, error=ConfigError)


def check_teacher_id(teacher_id: object, *, where: str = "teacher id") -> str:
    """Return ``teacher_id`` if it is file-safe (``[A-Za-z0-9][A-Za-z0-9_.-]*``, ≤128 chars)
    and not reserved (``actor``, ``student``, ``rl``); raise :class:`ConfigError` otherwise."""
    if not isinstance(teacher_id, str) or not _ID_RE.fullmatch(teacher_id):
        raise ConfigError(
            f"{where} {teacher_id!r} is not file-safe: use [A-Za-z0-9][A-Za-z0-9_.-]* (at most 128 chars)"
        )
    if teacher_id in RESERVED_TEACHER_IDS:
        raise ConfigError(f"{where} {teacher_id!r} is reserved ({sorted(RESERVED_TEACHER_IDS)})")
    return teacher_id


@dataclass(kw_only=True, slots=True)
class MOPDLossConfig:
    """Sampled-token distillation objective (see :func:`mopd.objectives.mopd_pg_loss`)."""

    aggregation: Aggregation = Aggregation.geometric
    """How teachers combine per token: ``geometric`` (A = Σ_j w_j ℓ_j − W·sg ℓθ, weights
    unnormalized), ``arithmetic`` (A = log Σ_j ŵ_j π_j − sg ℓθ, ŵ = w / W) or ``mean``
    (A = Σ_j ŵ_j ℓ_j − sg ℓθ, the per-teacher advantages averaged)."""
    is_cap: float = dataclasses.field(default=5.0, metadata={"allow_inf": True})
    """Upper truncation of the detached importance weight ρ = π_θ/π_old (> 0; ``inf`` = none)."""
    is_floor: float = 0.0
    """Lower truncation of ρ; ``[is_floor, is_cap]`` is the band (0 = plain cap)."""
    adv_clip: float | None = None
    """Clip the distillation advantage to ``[-adv_clip, adv_clip]`` (None = no clip)."""
    rl_adv_coef: float = 0.0
    """α in A = A_distill + α·A_rl (MiMo-style combination; needs ``rl_advantages``)."""
    rl_coef: float = 0.0
    """Weight of the RL loss in ``rl_coef·L_rl + distill_coef·L_mopd``; 0 skips the RL term."""
    distill_coef: float = 1.0
    """Weight of the distillation loss; 0 skips the distillation term."""
    check_finite: bool = True
    """Raise :class:`~mopd.errors.NonFiniteInputError` on NaN/inf at active tokens (one sync)."""

    def __post_init__(self) -> None:
        _validate(self, name="loss")
        if not (isinstance(self.is_cap, int | float) and self.is_cap > 0 and not math.isnan(self.is_cap)):
            raise ConfigError(f"loss.is_cap must be > 0 (inf allowed), got {self.is_cap!r}")
        _finite("loss.is_floor", self.is_floor, nonneg=True)
        if self.is_floor >= self.is_cap:
            raise ConfigError(f"loss.is_floor={self.is_floor!r} must be < loss.is_cap={self.is_cap!r}")
        if self.adv_clip is not None:
            _finite("loss.adv_clip", self.adv_clip, positive=True)
        _finite("loss.rl_adv_coef", self.rl_adv_coef)
        _finite("loss.rl_coef", self.rl_coef, nonneg=True)
        _finite("loss.distill_coef", self.distill_coef, nonneg=True)
        if self.rl_coef == 0 and self.distill_coef == 0:
            raise ConfigError("loss.rl_coef and loss.distill_coef are both 0: nothing to train")


@dataclass(kw_only=True, slots=True)
class DivergenceConfig:
    """Full-vocabulary / top-k divergences (see :mod:`mopd.divergences`)."""

    kind: Divergence = Divergence.reverse_kl
    """``forward_kl`` KL(T‖S), ``reverse_kl`` KL(S‖T) or ``jsd`` (generalized JSD(β))."""
    beta: float = 0.5
    """JSD interpolation in [0, 1]: M = (1−β)·S + β·T; β = 0 is forward KL, β = 1 reverse KL."""
    temperature: float = 1.0
    """Student logits are divided by this before the softmax (teacher inputs are log-probs
    already scored at the same temperature)."""
    top_k_tail: TopKTail = TopKTail.bucket
    """Top-k only: ``bucket`` adds one tail category holding the remaining mass (exact KL of
    the coarsened distributions), ``renorm`` renormalizes both over the k ids."""
    chunk_rows: int = 1024
    """Rows per chunk; bounds the temporaries to ``[chunk_rows, V]``."""
    check_finite: bool = True
    """Raise :class:`~mopd.errors.NonFiniteInputError` on NaN/inf in an active row (teacher
    log-probs may be −inf: probability 0). One host sync per chunk."""

    def __post_init__(self) -> None:
        _validate(self, name="divergence")
        _finite("divergence.beta", self.beta)
        if not 0.0 <= self.beta <= 1.0:
            raise ConfigError(f"divergence.beta must be in [0, 1], got {self.beta!r}")
        _finite("divergence.temperature", self.temperature, positive=True)
        if isinstance(self.chunk_rows, bool) or not isinstance(self.chunk_rows, int) or self.chunk_rows < 1:
            raise ConfigError(f"divergence.chunk_rows must be a positive int, got {self.chunk_rows!r}")


@dataclass(kw_only=True, slots=True)
class RoutingSpec:
    """Dataset field → route → {teacher_id: weight}. A route may blend several teachers."""

    field: str = "task_type"
    """Sample key read to pick the route (value ``str`` or ``int``, never ``bool``)."""
    routes: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    """``{route: {teacher_id: weight}}``; weights finite, ≥ 0, at least one > 0 per route.
    Integer field values match the route named by their decimal string. Empty only as a
    schema default: :class:`MOPDConfig` requires at least one route."""
    default_route: str | None = None
    """Route for samples whose field is missing or names no route (only when not strict)."""
    strict: bool = True
    """When True a missing field or unknown route raises :class:`~mopd.errors.RoutingError`."""

    def __post_init__(self) -> None:
        _validate(self, name="routing")
        if not isinstance(self.field, str) or not self.field:
            raise ConfigError(f"routing.field must be a non-empty str, got {self.field!r}")
        if self.field == ROUTE_KEY:
            raise ConfigError(f"routing.field may not be the reserved key {ROUTE_KEY!r}")
        if not isinstance(self.routes, dict):
            raise ConfigError(f"routing.routes must be a mapping, got {self.routes!r}")
        for route, weights in self.routes.items():
            if not isinstance(route, str) or not route:
                raise ConfigError(f"routing.routes key {route!r} must be a non-empty str")
            if not isinstance(weights, dict) or not weights:
                raise ConfigError(f"routing.routes[{route!r}] must map teacher ids to weights, got {weights!r}")
            for tid, w in weights.items():
                check_teacher_id(tid, where=f"routing.routes[{route!r}] teacher id")
                _finite(f"routing.routes[{route!r}][{tid!r}]", w, nonneg=True)
            if not any(w > 0 for w in weights.values()):
                raise ConfigError(f"routing.routes[{route!r}] has no positive weight: {weights!r}")
        if self.default_route is not None and self.default_route not in self.routes:
            raise ConfigError(
                f"routing.default_route={self.default_route!r} is not a route ({sorted(self.routes)})"
            )
        if self.strict and self.default_route is not None:
            raise ConfigError("routing.default_route is set but routing.strict=True would never use it")

    def teacher_ids(self) -> list[str]:
        """Teachers with a positive weight in some route, sorted."""
        return sorted({t for ws in self.routes.values() for t, w in ws.items() if w > 0})

    def check_teachers(self, known: set[str] | list[str] | tuple[str, ...]) -> None:
        """Raise :class:`ConfigError` if a route names a teacher not in ``known``."""
        known = set(known)
        for route, weights in self.routes.items():
            unknown = sorted(set(weights) - known)
            if unknown:
                raise ConfigError(f"routing.routes[{route!r}] names unknown teachers {unknown}; known: {sorted(known)}")


@dataclass(kw_only=True, slots=True)
class TeacherSpec:
    """One teacher. ``megatron``: a frozen Megatron GPT in the trainer's layout, loaded from
    ``checkpoint`` (or, when that is None, from the HF folder ``hf_path``); ``http``: an
    SGLang-compatible ``/generate`` server at ``url``."""

    backend: TeacherBackend = TeacherBackend.megatron
    """``megatron`` or ``http``."""
    checkpoint: str | None = None
    """This teacher's weights (megatron backend): a teacher-shard folder, a Megatron
    ``dist_checkpointing`` folder, or an HF folder (``config.json`` + safetensors, read with
    :func:`mcore_distill.hf.load_hf_checkpoint` into the trainer's layout). None: ``hf_path``."""
    hf_path: str | None = None
    """HF model folder (``config.json``, tokenizer files) used for compatibility fingerprints;
    a megatron teacher without ``checkpoint`` loads its weights from here."""
    url: str | None = None
    """Server base URL, e.g. ``http://10.0.0.7:30000`` (http backend)."""
    timeout_s: float = 60.0
    """Budget of one http request (a health check, or one ``/generate`` of ``max_batch`` rows),
    seconds: connecting, waiting, reading, every retry and backoff included."""
    max_retries: int = 2
    """Retries after a failed attempt (refused/reset connection, reply cut short, 5xx) within
    ``timeout_s``; then BROKEN."""
    retry_backoff_s: float = 0.5
    """Sleep before retry ``i`` is ``retry_backoff_s · 2**i`` seconds."""
    max_batch: int = 64
    """Samples per http request."""
    server_scales_temperature: bool = False
    """http backend: the server returns input-token log-probs of softmax(logits / τ) for the
    request temperature (required when ``rollout_temperature != 1``; SGLang does not by default)."""
    vocab_size: int | None = None
    """The teacher's real ``vocab_size`` (default: read from ``hf_path``'s ``config.json``).
    http backend: SGLang reports input token id ``vocab_size − 1`` as 0; knowing the size lets
    the client accept exactly that substitution while checking every other id. megatron backend:
    the host's padded output rows past it leave the softmax (:class:`mopd.megatron.MegatronTeacher`)."""

    @property
    def weights_path(self) -> str | None:
        """Where a megatron teacher's weights are read from: ``checkpoint``, else ``hf_path``."""
        return self.checkpoint or self.hf_path

    def __post_init__(self) -> None:
        _validate(self, name="teacher")
        if self.backend == "http" and not self.url:
            raise ConfigError("teacher.url is required for backend='http'")
        _finite("teacher.timeout_s", self.timeout_s, positive=True)
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ConfigError(f"teacher.max_retries must be an int >= 0, got {self.max_retries!r}")
        _finite("teacher.retry_backoff_s", self.retry_backoff_s, nonneg=True)
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise ConfigError(f"teacher.max_batch must be a positive int, got {self.max_batch!r}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool) or not isinstance(self.vocab_size, int)
                                            or self.vocab_size < 2):
            raise ConfigError(f"teacher.vocab_size must be an int >= 2 or None, got {self.vocab_size!r}")


@dataclass(kw_only=True, slots=True)
class TeacherTreeConfig:
    """Megatron teachers score harts tree batches: the rows of a scoring batch are packed as a
    prefix forest (shared prompts and duplicate rollouts computed once), run through the frozen
    model with tree attention and RoPE by trie depth, and read through harts' chunked LM head
    (see ``docs/harts.md``); per-row log-probs are restored by index. Same values as plain
    scoring up to float reduction order (tested at 1e-10 in fp64)."""

    enabled: bool = False
    """Score Megatron teachers with harts tree batches instead of padded ``[B, L]`` micro-batches."""
    backend: AttentionBackend = AttentionBackend.flex
    """Tree attention, a :class:`harts.AttentionBackend` name: ``flex`` (FlexAttention), ``varlen``
    (FlashAttention-2 per trie segment, bf16/fp16 on CUDA) or ``dense`` (a [T, T] mask; CPU tests)."""
    chunk_size: int = 1024
    """Rows per chunk of the LM head (extra memory ≈ 2 · chunk_size · V/TP fp32 values)."""
    token_cap: int = 8192
    """Most compact rows per tree micro-batch, alignment padding included (harts planner)."""
    align: int = 128
    """Compact rows of each micro-batch are padded to a multiple of this; divides ``token_cap``."""
    fallback_compression: float = dataclasses.field(default=1.05, metadata={"allow_inf": True})
    """Micro-batches compressing less than this (C = ΣL / T) run as plain packed sequences
    through the same kernels (same default as ``harts.PlannerConfig``; ``inf``: always packed)."""

    def __post_init__(self) -> None:
        _validate(self, name="teacher_tree")
        for name in ("chunk_size", "token_cap", "align"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"teacher_tree.{name} must be a positive int, got {v!r}")
        if self.token_cap % self.align:
            raise ConfigError(f"teacher_tree.align={self.align!r} must divide teacher_tree.token_cap={self.token_cap!r}")
        if not self.fallback_compression >= 0:  # inf allowed (always packed); NaN refused above
            raise ConfigError(f"teacher_tree.fallback_compression must be >= 0, got {self.fallback_compression!r}")


@dataclass(kw_only=True, slots=True)
class TeacherPoolConfig:
    """Lifecycle of teachers (see :class:`mopd.teachers.TeacherPool`)."""

    prefetch: bool = True
    """Stage the next required teacher's weights in the background while one scores."""
    wait_timeout_s: float = 600.0
    """Bound on every wait of the pool: for a prefetch to finish, for another lease to end,
    seconds. (Loading itself runs on the caller's thread, bounded by the back-end: HTTP
    timeouts, the process group's collective timeout.)"""

    def __post_init__(self) -> None:
        _validate(self, name="pool")
        _finite("pool.wait_timeout_s", self.wait_timeout_s, positive=True)


@dataclass(kw_only=True, slots=True)
class MOPDConfig:
    """Everything MOPD needs: teachers, routes, objective, divergences, lifecycle."""

    teachers: dict[str, TeacherSpec] = dataclasses.field(default_factory=dict)
    """``{teacher_id: TeacherSpec}``; ids are file-safe and not reserved."""
    routing: RoutingSpec = dataclasses.field(default_factory=RoutingSpec)
    """Dataset field and routes."""
    loss: MOPDLossConfig = dataclasses.field(default_factory=MOPDLossConfig)
    """Sampled-token objective and RL composition."""
    divergence: DivergenceConfig = dataclasses.field(default_factory=DivergenceConfig)
    """Full-vocab / top-k divergences, when teacher logits are available."""
    pool: TeacherPoolConfig = dataclasses.field(default_factory=TeacherPoolConfig)
    """Teacher lifecycle."""
    teacher_tree: TeacherTreeConfig = dataclasses.field(default_factory=TeacherTreeConfig)
    """harts tree scoring of Megatron teachers (off by default)."""
    rollout_temperature: float = 1.0
    """Sampling temperature of the rollouts; teachers score at this same temperature."""
    student_hf_path: str | None = None
    """HF folder of the student, for compatibility fingerprints (pre-flight)."""

    def __post_init__(self) -> None:
        _validate(self, name="mopd")
        if not self.teachers:
            raise ConfigError("mopd.teachers is empty: configure at least one teacher")
        if not self.routing.routes:
            raise ConfigError("routing.routes is empty: configure at least one route")
        for tid in self.teachers:
            check_teacher_id(tid, where="mopd.teachers key")
        self.routing.check_teachers(list(self.teachers))
        _finite("mopd.rollout_temperature", self.rollout_temperature, positive=True)
        for tid, spec in self.teachers.items():
            if spec.backend == "http" and self.rollout_temperature != 1.0 and not spec.server_scales_temperature:
                raise ConfigError(
                    f"teachers[{tid!r}]: rollout_temperature={self.rollout_temperature!r} needs "
                    "server_scales_temperature=True (a server that scales input-token log-probs)")
        if self.divergence.temperature != self.rollout_temperature:
            raise ConfigError(
                f"divergence.temperature={self.divergence.temperature!r} differs from "
                f"rollout_temperature={self.rollout_temperature!r}: teachers must score at the rollout temperature"
            )
