"""Configs of the shared teacher source (kw_only dataclasses; usable as Hydra structured configs).

A :class:`SourceConfig` names the teacher output everybody agrees on (:class:`CompatKey`), the
nodes with their admission limits (:class:`NodeLimits`) and the students that will subscribe
(:class:`StudentSpec`). Field validation runs in ``__post_init__`` and raises
:class:`~shared_teacher.errors.SourceConfigError` naming the field and the value; the
progress proof across fields is :func:`shared_teacher.admission.preflight`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from mcore_distill.validate import validate_fields
from shared_teacher.errors import SourceConfigError, SourceConfigTypeError

__all__ = ["SIGNALS", "CompatKey", "NodeLimits", "StudentSpec", "SourceConfig", "kill_grace_s"]

SIGNALS = ("logprobs", "topk", "hidden")
"""Teacher signals a source can capture: sampled-token log-probs, top-k log-probs, hidden taps."""


def _validate(obj: object) -> None:
    validate_fields(obj, error=SourceConfigError, type_error=SourceConfigTypeError)


def kill_grace_s(teardown_timeout_s: float) -> float:
    """How long fencing waits after SIGKILLing a failed student's owned processes for them to be
    reaped: ``min(teardown_timeout_s, 5) + 0.5`` seconds."""
    return min(teardown_timeout_s, 5.0) + 0.5


def _positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise SourceConfigError(f"{type(obj).__name__}.{name} must be a positive int, got {value!r}")


def _non_negative(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise SourceConfigError(f"{type(obj).__name__}.{name} must be >= 0, got {value!r}")


@dataclass(kw_only=True)
class CompatKey:
    """What a student must agree on with the source to share its features.

    Equality fields must match exactly; ``signals`` and ``hidden_taps`` of a student must be a
    subset of the source's and its ``top_k`` at most the source's (the source captures the union).
    """

    teacher_fingerprint: str
    """Hash of the teacher weights (see :func:`shared_teacher.features.fingerprint_state_dict`)."""
    tokenizer: str
    """Tokenizer and chat-template identity (name + revision or hash)."""
    signals: list[str] = field(default_factory=lambda: ["logprobs"])
    """Captured signals, a subset of ``logprobs``, ``topk``, ``hidden``."""
    top_k: int = 0
    """Number of top log-probs per position (0 when ``topk`` is not captured)."""
    hidden_taps: list[int] = field(default_factory=list)
    """Decoder layer indices whose outputs are captured (``hidden`` signal)."""
    dtype: str = "float32"
    """Storage dtype of floating features (``float32``, ``bfloat16``, ``float16``)."""
    max_length: int = 512
    """Sequences are truncated to this many tokens before the teacher forward."""
    dataset: str = ""
    """Dataset identity (name + revision or content hash)."""
    seed: int = 0
    """Seed of the per-epoch sample order."""
    epoch_order: str = "permute"
    """``permute``: a seeded permutation per epoch; ``sequential``: dataset order every epoch."""
    rollout_policy_version: str = ""
    """On-policy only: the behaviour policy version that generated the sequences ('' off-policy)."""

    _SUBSET_FIELDS = ("signals", "hidden_taps")

    def __post_init__(self) -> None:
        _validate(self)
        bad = [s for s in self.signals if s not in SIGNALS]
        if bad:
            raise SourceConfigError(f"CompatKey.signals has unknown entries {bad}; choose from {list(SIGNALS)}")
        if not self.signals:
            raise SourceConfigError("CompatKey.signals must name at least one signal, got []")
        if "topk" in self.signals:
            _positive(self, "top_k")
        if "hidden" in self.signals and not self.hidden_taps:
            raise SourceConfigError("CompatKey.hidden_taps must be non-empty when 'hidden' is captured, got []")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise SourceConfigError(f"CompatKey.dtype must be float32/bfloat16/float16, got {self.dtype!r}")
        if self.epoch_order not in ("permute", "sequential"):
            raise SourceConfigError(f"CompatKey.epoch_order must be 'permute' or 'sequential', got {self.epoch_order!r}")
        _positive(self, "max_length")

    def differences(self, student: CompatKey) -> dict[str, tuple]:
        """Fields where ``student`` cannot be served by a source with this key: name → (source, student)."""
        out: dict[str, tuple] = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(student, f.name)
            if f.name in self._SUBSET_FIELDS:
                if f.name == "hidden_taps" and "hidden" not in student.signals:
                    continue
                if not set(theirs) <= set(mine):
                    out[f.name] = (mine, theirs)
            elif f.name == "top_k":
                if "topk" in student.signals and theirs > mine:
                    out[f.name] = (mine, theirs)
            elif mine != theirs:
                out[f.name] = (mine, theirs)
        return out

    def schema_key(self) -> str:
        """A short stable id of the feature layout (stamped on every :class:`SampleRef`)."""
        import hashlib
        import json

        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(kw_only=True)
class NodeLimits:
    """Admission limits of one node's feature pool (latched hysteresis: pause at high, resume at low)."""

    high_samples: int
    """Pause admission when this many samples are in flight (admitted, not yet freed)."""
    low_samples: int
    """Resume admission once in-flight samples fall to this many or fewer."""
    high_tokens: int = 0
    """Pause admission at this many in-flight tokens (0: no token gauge; needed for packed students)."""
    low_tokens: int = 0
    """Resume admission at this many in-flight tokens or fewer."""
    byte_cap: int = 0
    """Hard cap on in-flight bytes (0: none). Never pauses admission below one dispatch quantum."""

    def __post_init__(self) -> None:
        _validate(self)
        _positive(self, "high_samples")
        _non_negative(self, "low_samples", "high_tokens", "low_tokens", "byte_cap")
        if self.low_samples > self.high_samples:
            raise SourceConfigError(
                f"NodeLimits.low_samples={self.low_samples} must be <= high_samples={self.high_samples}")
        if self.low_tokens > self.high_tokens:
            raise SourceConfigError(
                f"NodeLimits.low_tokens={self.low_tokens} must be <= high_tokens={self.high_tokens}")


@dataclass(kw_only=True)
class StudentSpec:
    """One independent student run: its ranks per node, batch shape and packing choice.

    Its ranks are node-major: ranks ``0..n_0-1`` sit on the first node of ``ranks_per_node``.
    Pins last until the optimizer step, so one dispatch window per node holds
    ``ranks × micro_batch_size × accumulation_steps`` samples (unpacked) or
    ``ranks × pack_budget_tokens × accumulation_steps`` tokens (packed).
    """

    name: str
    """Unique student name (also its ledger file name)."""
    ranks_per_node: dict[str, int]
    """Node id → number of reader ranks of this student on that node (DP ranks × SP)."""
    micro_batch_size: int = 1
    """Samples per micro-batch per rank (unpacked students)."""
    accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    packed: bool = False
    """Pack samples into micro-batches of at most ``pack_budget_tokens`` tokens (next-fit, in order)."""
    pack_budget_tokens: int = 0
    """Token budget of one packed micro-batch (packed students only)."""

    def __post_init__(self) -> None:
        _validate(self)
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise SourceConfigError(f"StudentSpec.name must be non-empty [A-Za-z0-9-_.], got {self.name!r}")
        _positive(self, "micro_batch_size", "accumulation_steps")
        if not self.ranks_per_node or any(
                not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in self.ranks_per_node.values()):
            raise SourceConfigError(
                f"StudentSpec.ranks_per_node must map node → positive int, got {self.ranks_per_node!r}")
        if self.packed:
            _positive(self, "pack_budget_tokens")

    @property
    def world_size(self) -> int:
        return sum(self.ranks_per_node.values())

    def rank_nodes(self) -> list[str]:
        """Node of every rank, node-major (rank r reads features from ``rank_nodes()[r]``)."""
        return [n for n, k in self.ranks_per_node.items() for _ in range(k)]

    def quantum(self, node: str) -> int:
        """Per-node dispatch quantum: samples (unpacked) or tokens (packed) one window needs."""
        per_rank = self.pack_budget_tokens if self.packed else self.micro_batch_size
        return self.ranks_per_node.get(node, 0) * per_rank * self.accumulation_steps


@dataclass(kw_only=True)
class SourceConfig:
    """A shared teacher source: one teacher stream, several students."""

    key: CompatKey
    """What the source produces; students subscribe with a compatible key."""
    nodes: dict[str, NodeLimits]
    """Node id → admission limits. Position ``p`` of an epoch lives on node ``nodes[p % len(nodes)]``."""
    students: list[StudentSpec]
    """Every student that will subscribe; production starts once all have subscribed."""
    dataset_size: int
    """Number of samples per epoch."""
    num_epochs: int = 1
    """Epochs to produce (a resumed source starts at the oldest epoch any student still needs)."""
    max_sample_bytes: int
    """Upper bound of one sample object's bytes (admission reserves this before the put)."""
    max_seq_len: int
    """Upper bound of one sample's tokens."""
    min_seq_len: int = 1
    """Lower bound of one sample's tokens (the producer refuses shorter ones); bounds packed quanta in samples."""
    lag_cap_samples: int = 1 << 30
    """A student may start a window only while it has settled at most this many more samples than the slowest
    live student (the slowest is never held back, so the cap cannot deadlock)."""
    allow_unproven_layout: bool = False
    """Opt-in: start even when preflight cannot prove progress for this multi-node layout (uneven rank
    splits or packed students on several nodes whose caps do not cover the cross-node skew bound;
    see :func:`shared_teacher.admission.preflight`). Preflight then warns instead of raising
    :class:`~shared_teacher.errors.CrossNodeSkewError` and the watchdog is the only guard. The per-node
    necessary checks still raise."""
    lease_timeout_s: float = 10.0
    """A reader that has not heartbeated for this long is considered failed."""
    teardown_timeout_s: float = 10.0
    """How long fencing waits for a failed student's processes to exit before killing owned pids."""
    watchdog_s: float = 60.0
    """No progress for this long (while work remains) → dump state and fail with SourceStalledError.
    Must exceed :attr:`recovery_bound_s` (a dead reader's lease expiring, then its fence), or the
    watchdog would fail every student while a failure is still being handled; and it should
    exceed the longest legitimate pause of the whole stream (a slow optimizer step of the
    slowest student, a checkpoint save)."""
    state_dir: str = ""
    """Folder for per-student ledgers and watchdog dumps ('' → no files)."""

    def __post_init__(self) -> None:
        _validate(self)
        _positive(self, "dataset_size", "num_epochs", "max_sample_bytes", "max_seq_len", "min_seq_len")
        _non_negative(self, "lag_cap_samples")
        if self.min_seq_len > self.max_seq_len:
            raise SourceConfigError(
                f"SourceConfig.min_seq_len={self.min_seq_len} exceeds max_seq_len={self.max_seq_len}")
        for name in ("lease_timeout_s", "teardown_timeout_s", "watchdog_s"):
            if getattr(self, name) <= 0:
                raise SourceConfigError(f"SourceConfig.{name} must be > 0, got {getattr(self, name)!r}")
        if not self.watchdog_s > self.recovery_bound_s:
            raise SourceConfigError(
                f"SourceConfig.watchdog_s={self.watchdog_s!r} must exceed lease_timeout_s + teardown_timeout_s + "
                f"kill grace = {self.lease_timeout_s!r} + {self.teardown_timeout_s!r} + "
                f"{kill_grace_s(self.teardown_timeout_s)!r} = {self.recovery_bound_s!r}s: a dead reader is detected "
                f"after lease_timeout_s and fenced within teardown_timeout_s + kill grace, and a shorter watchdog "
                f"fails every student first")
        if not self.nodes:
            raise SourceConfigError("SourceConfig.nodes must name at least one node, got {}")
        if not self.students:
            raise SourceConfigError("SourceConfig.students must list at least one student, got []")
        names = [s.name for s in self.students]
        if len(set(names)) != len(names):
            raise SourceConfigError(f"SourceConfig.students has duplicate names: {names}")
        for s in self.students:
            unknown = set(s.ranks_per_node) - set(self.nodes)
            if unknown:
                raise SourceConfigError(
                    f"StudentSpec {s.name!r}.ranks_per_node names unknown nodes {sorted(unknown)}; "
                    f"SourceConfig.nodes has {list(self.nodes)}")
        if self.max_seq_len > self.key.max_length:
            raise SourceConfigError(
                f"SourceConfig.max_seq_len={self.max_seq_len} exceeds key.max_length={self.key.max_length}")

    @property
    def recovery_bound_s(self) -> float:
        """Longest silence a handled failure causes: a dead reader's lease expires after
        ``lease_timeout_s``, its fence waits ``teardown_timeout_s`` and then the kill grace."""
        return self.lease_timeout_s + self.teardown_timeout_s + kill_grace_s(self.teardown_timeout_s)

    def student(self, name: str) -> StudentSpec:
        for s in self.students:
            if s.name == name:
                return s
        raise SourceConfigError(f"unknown student {name!r}; SourceConfig.students has {[s.name for s in self.students]}")
