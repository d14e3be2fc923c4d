"""harts: tree execution of shared-prefix rollouts on Megatron-Core.

Exports what a trainer calls: the Megatron entry points (``tree_logprobs``, ``apply_harts``,
``tree_layer_spec``, ``make_tree_params``, ``tree_forward``), planning (``plan_tree_batch``,
``plan_step``, the configs), forests, the per-sequence losses, the tree LM head and attention, and
the errors a caller catches. The Megatron names live in :mod:`harts.megatron` (with the
Gated DeltaNet layer swap in :mod:`harts.gdn_megatron`), the only submodules importing
``megatron.core``; they are loaded on first use, so ``import harts`` does not import Megatron-Core.

Everything else is imported from its module: every error from :mod:`harts.errors`, shared-prefix
groups (``tree_shared_step``, ``make_shared_params``) from :mod:`harts.megatron` and
:mod:`harts.prefix`, DP row exchange from :mod:`harts.exchange`, the GDN kernels from
:mod:`harts.gdn`, the varlen and Triton kernels from :mod:`harts.varlen` /
:mod:`harts.lm_head_triton`, plans and statistics from :mod:`harts.planner` and
:mod:`harts.batch`, synthetic workloads from :mod:`harts.workload`, plain-torch references from
:mod:`harts.reference` and :mod:`harts.gdn_reference`.
"""

from harts.attention import tree_attention
from harts.batch import plan_tree_batch
from harts.config import AttentionBackend, CostModelConfig, HeadConfig, PlannerConfig
from harts.errors import HartsConfigError, HartsError, TreeIncompatibleError
from harts.forest import Forest, build_forest
from harts.gdn import GdnTreeConfig
from harts.lm_head import tree_lm_head
from harts.loss import (
    aggregate_loss,
    global_normalizers,
    ppo_clip_token_loss,
    sequence_entropy,
    sequence_logprobs,
)
from harts.planner import plan_step, sharing_stats

_MEGATRON = ("tree_logprobs", "apply_harts", "tree_layer_spec", "make_tree_params", "tree_forward")

__all__ = [
    *_MEGATRON,
    "plan_tree_batch", "plan_step", "sharing_stats",
    "AttentionBackend", "PlannerConfig", "CostModelConfig", "HeadConfig", "GdnTreeConfig",
    "Forest", "build_forest",
    "sequence_logprobs", "sequence_entropy", "ppo_clip_token_loss", "aggregate_loss", "global_normalizers",
    "tree_lm_head", "tree_attention",
    "HartsError", "HartsConfigError", "TreeIncompatibleError",
]


def __getattr__(name):
    if name in _MEGATRON:
        from harts import megatron

        return getattr(megatron, name)
    raise AttributeError(f"module 'harts' has no attribute {name!r}")
