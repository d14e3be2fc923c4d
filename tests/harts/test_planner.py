"""Planner, sharing statistics, workloads and the DP row exchange."""

from __future__ import annotations

import pytest
import torch

from harts.config import CostModelConfig, HartsConfigError, PlannerConfig
from harts.planner import CapacityError, PlanError, fit_cost_model, plan_step, sharing_stats
from harts.workload import caterpillar, grpo_for_sharing, grpo_groups


def test_grpo_stats_match_closed_form():
    p, r, n = 40, 10, 8
    st = sharing_stats(grpo_groups(3, prompt_len=p, response_len=r, n=n, vocab_size=50000))
    assert st.compression == pytest.approx(n * (p + r) / (p + n * r))
    assert st.attention_ratio == pytest.approx(n * (p + r) * (p + r + 1) / 2 / (p * (p + 1) / 2 + n * sum(
        range(p + 1, p + r + 1))))
    assert st.fork_edges == 3 * n and st.max_depth == p + r - 1 and st.num_segments == 3 * (n + 1)


@pytest.mark.parametrize("rho", [0.0, 0.25, 0.5, 0.75, 0.9])
def test_grpo_for_sharing(rho):
    st = sharing_stats(grpo_for_sharing(rho, num_groups=2, n=16, seq_len=300, vocab_size=1 << 20))
    assert abs(st.sharing_ratio - rho) < 0.01


def test_caterpillar_shape():
    s = caterpillar(1, turns=3, turn_len=5, branches=2, branch_len=4, vocab_size=1 << 20)
    assert len(s) == 7 and [len(x) for x in s] == [9, 9, 14, 14, 19, 19, 15]
    st = sharing_stats(s)
    assert st.tree_tokens == 15 + 6 * 4


def _covers(plan, n):
    ids = sorted(g for mb in plan.microbatches for g in mb.seq_ids)
    assert ids == list(range(n)), "every sequence planned exactly once"


def test_plan_cap_alignment_and_fallback():
    seqs = grpo_groups(6, prompt_len=300, response_len=40, n=8, vocab_size=1 << 20, seed=1)  # C ≈ 4.8
    seqs += grpo_groups(4, prompt_len=4, response_len=500, n=4, vocab_size=1 << 20, seed=2)  # C ≈ 1.0
    cfg = PlannerConfig(token_cap=1024, align=64, fallback_compression=1.15, dp_size=2)
    plan = plan_step(seqs, cfg)
    _covers(plan, len(seqs))
    assert len(plan.ranks[0]) == len(plan.ranks[1])
    for mb in plan.microbatches:
        assert mb.rows <= 1024 and mb.rows % 64 == 0 and mb.real_rows <= mb.rows
        f = mb.build(seqs)
        assert f.num_nodes == mb.rows and f.num_real == mb.real_rows
        assert [f.sequence(k).tolist() for k in range(len(mb.seq_ids))] == [seqs[g] for g in mb.seq_ids]
        if mb.mode == "thd":
            assert all(len(seqs[g]) > 400 for g in mb.seq_ids)
        else:
            assert mb.compression >= 1.15
    s = plan.summary()
    assert 0 < s["fallback_rate"] < 1 and s["num_microbatches"] == len(plan.microbatches)


def test_plan_balances_by_cost():
    seqs = [[i] * n for i, n in enumerate([500, 400, 300, 300, 200, 100, 100, 50])]
    plan = plan_step(seqs, PlannerConfig(token_cap=512, align=1, fallback_compression=2.0, dp_size=2,
                                         cost=CostModelConfig(c_token=1.0)))
    assert len(plan.ranks[0]) == len(plan.ranks[1])
    c = plan.rank_costs()
    assert abs(c[0] - c[1]) <= 100


def test_plan_errors():
    with pytest.raises(CapacityError, match=r"sequence 1 has length 300 \(384 rows after alignment to 128\)"):
        plan_step([[1, 2], [3] * 300], PlannerConfig(token_cap=256))
    with pytest.raises(PlanError, match="dp_size=4"):
        plan_step([[1, 2], [3]], PlannerConfig(token_cap=256, dp_size=4))
    with pytest.raises(HartsConfigError, match="align=100 must be >= 1 and divide token_cap=256"):
        PlannerConfig(token_cap=256, align=100)


def test_fit_cost_model_recovers_coefficients():
    rows = [100, 200, 400, 800, 300]
    pairs = [5000, 1000, 90000, 20000, 7000]
    secs = [0.5 + 0.01 * r + 1e-5 * p for r, p in zip(rows, pairs)]
    c = fit_cost_model(rows, pairs, secs)
    assert c.c0 == pytest.approx(0.5) and c.c_token == pytest.approx(0.01) and c.c_attn == pytest.approx(1e-5)


def exchange_body(rank, world):
    """Run inside a spawned 2-rank group (see test_multirank.py)."""
    from harts.exchange import RowExchange, gather_sequences

    g = torch.Generator().manual_seed(rank)
    local = [torch.randint(0, 100, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist()
             for _ in range(5 + 2 * rank)]
    seqs, counts = gather_sequences(local)
    assert counts == [5, 7] and seqs[counts[0] * rank:][: len(local)][0].tolist() == local[0]
    plan = plan_step([s.tolist() for s in seqs], PlannerConfig(token_cap=16, align=1, dp_size=world))
    ex = RowExchange(plan, counts)
    lens = torch.tensor([len(s) for s in seqs])
    adv = torch.tensor([float(1000 * rank + i) for i in range(len(local))], dtype=torch.float64)
    tok = torch.cat([torch.tensor(s, dtype=torch.float64) for s in local])
    got_adv = ex.to_plan(adv)
    got_tok = ex.to_plan(tok, lengths=lens)
    rows = ex.planned_rows
    base = [0, counts[0]]
    exp_adv = [1000 * (g_ >= counts[0]) + g_ - base[int(g_ >= counts[0])] for g_ in rows]
    assert got_adv.tolist() == exp_adv
    assert got_tok.tolist() == [float(t) for g_ in rows for t in seqs[g_].tolist()]
    # results come back to their owners in the original order
    back_adv = ex.from_plan(got_adv * 2)
    back_tok = ex.from_plan(got_tok + 0.5, lengths=lens)
    assert back_adv.tolist() == (adv * 2).tolist() and back_tok.tolist() == (tok + 0.5).tolist()
    return len(rows)


def test_configs_are_hydra_structured():
    from omegaconf import OmegaConf

    from harts.config import HeadConfig

    cfg = OmegaConf.merge(OmegaConf.structured(PlannerConfig), {"token_cap": 4096, "cost": {"c_attn": 1e-6}})
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, PlannerConfig) and obj.token_cap == 4096 and obj.cost.c_attn == 1e-6
    from mcore_distill.structured import to_dataclass

    with pytest.raises(HartsConfigError, match="HeadConfig.backend must be .* got 'flash'"):
        HeadConfig(backend="flash")
    with pytest.raises(HartsConfigError, match=r"backend: Invalid value 'flash', expected one of \[flex, varlen, dense\]"):
        to_dataclass({"backend": "flash"}, HeadConfig, error=HartsConfigError)
    with pytest.raises(HartsConfigError, match="CostModelConfig.c_token must be >= 0, got -1.0"):
        CostModelConfig(c_token=-1.0)
