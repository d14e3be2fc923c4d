"""ConversionArena under TP/EP > 1 (gloo, 2 ranks): the TP-merged and EP-gathered parameters are
written into the arena too, so every yielded tensor is a view of the trainer's parameter buffer
or the arena, bit-identical to the default path, at the same offsets on every pass, and a publish
sends those two storages in place with nothing packed."""

from __future__ import annotations

import pytest

from mcore_distill.testing import run_ranks

from ._ranks import arena_gathers

CASES = [
    {"id": "dense-tp2", "tp": 2},
    {"id": "moe-tp2-etp2-tied-router-bf16", "tp": 2, "experts": 4, "tied": True, "router_dtype": "bf16"},
    {"id": "moe-ep2", "tp": 1, "ep": 2, "experts": 4, "extra": {"expert_model_parallel_size": 2}},
    {"id": "moe-tp2-ep2-etp1", "tp": 2, "ep": 2, "etp": 1, "experts": 4,
     "extra": {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}},
    {"id": "hybrid-tp2", "tp": 2, "hybrid": True},
]


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_arena_holds_tp_and_ep_gathers():
    by_rank = run_ranks(arena_gathers, 2, CASES, timeout=280)
    for rank, results in enumerate(by_rank):
        assert [r["case"] for r in results] == [c["id"] for c in CASES]
        for r in results:
            assert r["names_equal"] and r["equal"] and r["equal_again"], r
            assert r["storages_ok"], r  # the flat parameter buffer or the arena, nothing fresh
            assert r["same_ptrs"], r  # stable offsets: a kept mapping stays valid
            assert r["arena_used"] == r["arena_capacity"] == r["nbytes"], r  # exact (no expert bias here)
            name, requested, used, capacity = r["capacity_error"]
            assert capacity == r["nbytes"] - 1 and used + requested > capacity, r
            if rank == 0 and r["case"] in ("dense-tp2", "moe-ep2", "moe-tp2-ep2-etp1"):
                assert r["buckets"] == 0 and 1 <= r["shared"] <= 2 and r["received_equal"], r
    # both ranks take the same offsets (same sizes, same order)
    assert [r["nbytes"] for r in by_rank[0]] == [r["nbytes"] for r in by_rank[1]]
