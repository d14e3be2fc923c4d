"""Configuration dataclasses (Hydra structured configs) for harts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from harts.errors import HartsConfigError, HartsConfigTypeError
from mcore_distill.validate import validate_fields

__all__ = ["AttentionBackend", "HartsConfigError", "CostModelConfig", "PlannerConfig", "HeadConfig"]


def _validate(obj: object) -> None:
    validate_fields(obj, error=HartsConfigError, type_error=HartsConfigTypeError)


class AttentionBackend(enum.StrEnum):
    """Tree attention backend: the one list of names that configs and functions accept (a member
    compares equal to its name, so ``"flex"`` and ``AttentionBackend.flex`` are interchangeable).

    * ``flex``: FlexAttention with a BlockMask built once per microbatch (forward only on CPU).
    * ``varlen``: FlashAttention-2 varlen kernels per trie segment (bf16/fp16 on CUDA; plain-torch
      kernels on CPU).
    * ``dense``: a ``[T, T]`` mask and SDPA (tests and tiny inputs).
    """

    flex = "flex"
    varlen = "varlen"
    dense = "dense"


@dataclass(kw_only=True, slots=True)
class CostModelConfig:
    """Linear cost of one microbatch: ``c0 + c_token · rows + c_attn · attention pairs``.

    ``rows`` counts padded compact rows (tree) or padded tokens (THD); attention pairs are
    ``Σ_v (depth_v + 1)`` for a tree and ``Σ_i L_i(L_i+1)/2`` for THD. Refit from measured step
    times with :func:`harts.planner.fit_cost_model` (the benchmark prints fitted values).
    """

    c0: float = 0.0
    """Fixed cost per microbatch (launch overhead)."""
    c_token: float = 1.0
    """Cost per row (projections, MLP, norms, LM head)."""
    c_attn: float = 0.0
    """Cost per attended (query, key) pair; 0 models token-linear-dominant shapes."""

    def __post_init__(self) -> None:
        _validate(self)
        for name in ("c0", "c_token", "c_attn"):
            v = getattr(self, name)
            if v < 0:
                raise HartsConfigError(f"CostModelConfig.{name} must be >= 0, got {v}")


@dataclass(kw_only=True, slots=True)
class PlannerConfig:
    """How rollouts are packed into microbatches and spread over DP ranks."""

    token_cap: int = 8192
    """Maximum rows per microbatch, alignment padding included (real compact tokens for trees,
    real tokens for THD)."""
    align: int = 128
    """Rows of each microbatch are padded to a multiple of this: the FlexAttention block size
    (128) for ``flex``; the varlen backend needs none, 16 keeps GEMM rows tensor-core friendly.
    Use ``lcm(align, TP)`` under tensor/sequence parallelism. Padding rows cost full compute."""
    fallback_compression: float = field(default=1.05, metadata={"allow_inf": True})
    """Microbatches with compression C = ΣL / T below this run as plain THD packing (no tree);
    ``inf`` always packs THD, 0 never does. A forest without sharing is exactly THD packing, so
    the tree pays off from just above C = 1; the margin covers packing differences.
    ``bench/harts.py`` reports the measured crossover (docs/harts.md records the evidence)."""
    dp_size: int = 1
    """Data-parallel ranks; every rank receives the same number of microbatches."""
    prefix_reuse: bool = False
    """A tree larger than ``token_cap`` runs as one *shared-prefix group* (:mod:`harts.prefix`) instead
    of being cut into trees that each repeat its prefix: the prefix's activations stay alive while the
    parts below it run (prefix rows + part rows ≤ ``token_cap``). Such microbatches (``mode="shared"``)
    run through :func:`harts.megatron.tree_shared_step`, not ``tree_forward``."""
    cost: CostModelConfig = field(default_factory=CostModelConfig)
    """Cost model used to balance ranks."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.token_cap < 1:
            raise HartsConfigError(f"PlannerConfig.token_cap must be >= 1, got {self.token_cap}")
        if self.align < 1 or self.token_cap % self.align:
            raise HartsConfigError(
                f"PlannerConfig.align={self.align} must be >= 1 and divide token_cap={self.token_cap}")
        if self.fallback_compression < 0:
            raise HartsConfigError(
                f"PlannerConfig.fallback_compression must be >= 0, got {self.fallback_compression}")
        if self.dp_size < 1:
            raise HartsConfigError(f"PlannerConfig.dp_size must be >= 1, got {self.dp_size}")


@dataclass(kw_only=True, slots=True)
class HeadConfig:
    """Tree-aware chunked LM head and attention options for :func:`harts.megatron.tree_forward`."""

    backend: AttentionBackend = AttentionBackend.flex
    """Tree attention backend, an :class:`AttentionBackend` name: ``flex`` (FlexAttention, BlockMask
    once per microbatch), ``varlen`` (FlashAttention-2 varlen per trie segment, bf16/fp16 on CUDA)
    or ``dense`` (tests only)."""
    chunk_size: int = 1024
    """Rows per LM-head forward chunk: ``chunk_size · V_local`` values alive (model dtype on the
    Triton path, fp32 on the torch path), plus the saved fp32 ``[T, H]`` ``A`` (harts.md, "LM head")."""
    temperature: float = 1.0
    """Sampling temperature τ; logits are divided by it."""
    entropy_requires_grad: bool = False
    """Make the returned entropy differentiable (entropy bonus)."""
    vocab_size: int | None = None
    """The real vocabulary when the model's is padded (Megatron pads to a multiple of
    ``make_vocab_size_divisible_by · TP``; the HF model has ``vocab_size`` rows): output rows at
    or past it leave the softmax, as in the HF model. None: every row of the output layer counts."""

    def __post_init__(self) -> None:
        _validate(self)
        if self.vocab_size is not None and self.vocab_size < 1:
            raise HartsConfigError(f"HeadConfig.vocab_size must be >= 1 or None, got {self.vocab_size}")
        if self.chunk_size < 1:
            raise HartsConfigError(f"HeadConfig.chunk_size must be >= 1, got {self.chunk_size}")
        if not self.temperature > 0:
            raise HartsConfigError(f"HeadConfig.temperature must be > 0, got {self.temperature}")
