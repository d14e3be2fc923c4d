"""harts: tree execution of shared-prefix rollouts on Megatron-Core.

Megatron integration (``apply_harts``, ``tree_forward``, ``tree_logprobs``...) lives in
:mod:`harts.megatron`, and the Gated DeltaNet layer swap (``TreeGatedDeltaNet``,
``apply_tree_gdn``) in :mod:`harts.gdn_megatron`; these two are the only submodules importing ``megatron.core`` and are
not imported here. DP row exchange is in :mod:`harts.exchange`.
"""

from harts.attention import build_block_mask, flex_tree_attention, tree_attention
from harts.batch import TreeBatch, TreeMicrobatch, plan_tree_batch
from harts.config import AttentionBackend, CostModelConfig, HartsConfigError, HeadConfig, PlannerConfig
from harts.forest import EmptySequenceError, Forest, TokenOutOfRangeError, build_chain_forest, build_forest
from harts.gdn import (
    GdnConfigError,
    GdnPlan,
    GdnShapeError,
    GdnTreeConfig,
    ancestor_table,
    build_gdn_plan,
    chain_rounds,
    tree_causal_conv1d,
    tree_gated_delta_rule,
)
from harts.gdn_reference import (
    causal_conv1d_reference,
    chunk_gated_delta_rule_reference,
    l2norm_reference,
    recurrent_gated_delta_rule_reference,
)
from harts.lm_head import TreeHeadOutput, tree_lm_head
from harts.loss import (
    aggregate_loss,
    global_normalizers,
    ppo_clip_token_loss,
    sequence_entropy,
    sequence_logprobs,
)
from harts.planner import (
    CapacityError,
    Microbatch,
    PlanError,
    SharingStats,
    StepPlan,
    fit_cost_model,
    plan_step,
    sharing_stats,
)
from harts.reference import (
    per_sequence_head_reference,
    tree_attention_reference,
    tree_head_reference,
    tree_mask,
)
from harts.workload import caterpillar, grpo_for_sharing, grpo_groups

__all__ = [
    "AttentionBackend", "TreeBatch", "TreeMicrobatch", "plan_tree_batch",
    "GdnConfigError", "GdnPlan", "GdnShapeError", "GdnTreeConfig", "ancestor_table", "build_gdn_plan",
    "causal_conv1d_reference", "chain_rounds", "chunk_gated_delta_rule_reference", "l2norm_reference",
    "recurrent_gated_delta_rule_reference", "tree_causal_conv1d", "tree_gated_delta_rule",
    "CapacityError", "CostModelConfig", "EmptySequenceError", "Forest", "HartsConfigError", "HeadConfig",
    "Microbatch", "PlanError", "PlannerConfig", "SharingStats", "StepPlan", "TokenOutOfRangeError",
    "TreeHeadOutput", "aggregate_loss", "build_block_mask", "build_chain_forest", "build_forest", "caterpillar",
    "fit_cost_model", "flex_tree_attention", "global_normalizers", "grpo_for_sharing", "grpo_groups",
    "per_sequence_head_reference", "plan_step", "ppo_clip_token_loss", "sequence_entropy", "sequence_logprobs",
    "sharing_stats", "tree_attention", "tree_attention_reference", "tree_head_reference", "tree_lm_head",
    "tree_mask",
]
