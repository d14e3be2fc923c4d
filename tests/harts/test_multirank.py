"""Two gloo ranks, one spawn (spawning costs ~10 s): vocab-parallel chunked LM head, the real
tiny GPT at TP=2 tree vs per-sequence in fp64 with recomputation, the DP row exchange, and a
full DP=2 step (Megatron DDP + get_forward_backward_func over planned, exchanged microbatches)
whose reduced gradients equal the per-sequence gradient of the global objective, and PP=2 with
variable-length tree microbatches through Megatron's pipeline schedule."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import run_ranks


def _body(rank, world):
    import torch.distributed as dist

    from harts.forest import build_forest
    from mcore_distill.testing import destroy_megatron, init_megatron
    from tests.harts.cases import CASES
    from tests.harts.test_lm_head import compare_head
    from tests.harts.test_megatron import run_exactness
    from tests.harts.test_planner import exchange_body

    compare_head(build_forest(CASES[1].values[0]), v=38, chunk=4, temp=0.9, ent_grad=True, dtype=torch.float64,
                 tol=1e-12, tp_group=dist.group.WORLD, rank=rank, world=world)
    rows = exchange_body(rank, world)
    init_megatron(tp=world)
    seqs = CASES[0].values[0] + CASES[3].values[0] + [[40, 50, 60, 41], [40, 50, 59]]  # both vocab shards
    n = run_exactness(seqs, dtype=torch.float64, recompute=True, tol=1e-10)
    destroy_megatron()
    from tests.harts.dp_step import dp_step_body

    checked, num_mb = dp_step_body(rank, world)
    assert num_mb >= 2, "the DP step must accumulate over several microbatches"
    from tests.harts.pp_step import pp_step_body

    pp_checked = pp_step_body(rank, world)
    return n, rows, checked, pp_checked


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_tp2_dp2_pp2_gloo():
    res = run_ranks(_body, 2, timeout=290)
    assert res[0][0] == res[1][0] > 0
    assert res[0][1] + res[1][1] == 12
    assert res[0][2] == res[1][2] > 0
    assert res[0][3] > 0 and res[1][3] > 0  # each pipeline stage checked its own parameters
