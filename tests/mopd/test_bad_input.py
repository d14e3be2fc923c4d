"""Wrong types and shapes at mopd's public entry points raise typed errors naming the argument."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.errors import ConfigTypeError
from mopd import MOPDLossConfig, TeacherPool, TeacherPoolConfig, TokenBatch, TokenTargets, TransformersTeacher
from mopd.objectives import mopd_pg_loss


def _targets(shape=(2, 5)):
    return TokenTargets(logp_sum=torch.zeros(shape), weight_sum=torch.ones(shape))


def test_teacher_pool_given_a_list():
    teacher = TransformersTeacher("t", torch.nn.Linear(2, 2))
    with pytest.raises(ConfigTypeError, match=r"TeacherPool backends must be a mapping \{teacher_id: backend\}, "
                                              r"got list"):
        TeacherPool([teacher], config=TeacherPoolConfig())
    with pytest.raises(ConfigTypeError, match="TeacherPool config must be a TeacherPoolConfig, got dict"):
        TeacherPool({"t": teacher}, config={"prefetch": False})


def test_token_batch_with_lists():
    with pytest.raises(ConfigTypeError, match=r"TokenBatch.input_ids must be a Tensor, got \[\[1, 2\]\] \(list\)"):
        TokenBatch([[1, 2]], torch.tensor([2]))
    with pytest.raises(ConfigTypeError, match=r"TokenBatch.lengths must be a Tensor, got \[2\] \(list\)"):
        TokenBatch(torch.tensor([[1, 2]]), [2])
    with pytest.raises(ConfigTypeError, match="TokenBatch.score_from must be"):
        TokenBatch(torch.tensor([[1, 2]]), torch.tensor([2]), [0])


def test_token_targets_types_shapes_and_indexing():
    with pytest.raises(ConfigTypeError, match="TokenTargets.logp_sum must be a Tensor"):
        TokenTargets(logp_sum=[0.0], weight_sum=torch.ones(1))
    with pytest.raises(ValueError, match=r"share one shape, got logp_sum \(2, 5\), weight_sum \(2, 4\)"):
        TokenTargets(logp_sum=torch.zeros(2, 5), weight_sum=torch.ones(2, 4))
    t = TokenTargets.from_teachers(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)), torch.ones(2, 3, 5))
    rows = t[torch.tensor([2, 0])]
    assert torch.equal(rows.logp_sum, t.logp_sum[[2, 0]]) and torch.equal(rows.mix_lse, t.mix_lse[[2, 0]])
    assert t[:, :-1].weight_sum.shape == (3, 4)


def test_plain_dicts_where_configs_are_expected():
    mask = torch.ones(2, 5, dtype=torch.bool)
    with pytest.raises(ConfigTypeError, match=r"config must be a MOPDLossConfig, got dict \(a plain dict"):
        mopd_pg_loss(torch.zeros(2, 5), torch.zeros(2, 5), _targets(), mask, config={"is_cap": 2.0})
    from mopd.preflight import run_preflight

    with pytest.raises(ConfigTypeError, match="config must be a MOPDConfig, got dict"):
        run_preflight({"teachers": {}})


def test_micro_batch_route_ids_of_the_wrong_shape(cpu_megatron):
    from mopd.megatron import MOPDMicroBatch, build_teacher_pool, mopd_loss_func

    B, L = 2, 5
    kw = dict(labels=torch.zeros(B, L, dtype=torch.long), loss_mask=torch.ones(B, L, dtype=torch.bool),
              old_logp=torch.zeros(B, L), targets=_targets((B, L)))
    with pytest.raises(ValueError, match=r"MOPDMicroBatch.route_ids has shape \(2,\), the token tensors have "
                                         r"\(2, 5\).*route_ids\[:, None\].expand_as"):
        MOPDMicroBatch(**kw, route_ids=torch.zeros(B, dtype=torch.long))
    with pytest.raises(ValueError, match="route_ids must hold integer route indices, got torch.float32"):
        MOPDMicroBatch(**kw, route_ids=torch.zeros(B, L))
    with pytest.raises(ConfigTypeError, match="MOPDMicroBatch.route_ids must be a Tensor, got"):
        MOPDMicroBatch(**kw, route_ids=[[0] * L] * B)
    with pytest.raises(ValueError, match=r"MOPDMicroBatch.targets has shape \(2, 4\)"):
        MOPDMicroBatch(**{**kw, "targets": _targets((B, L - 1))}, route_ids=torch.zeros(B, L, dtype=torch.long))
    micro = MOPDMicroBatch(**kw, route_ids=torch.zeros(B, L, dtype=torch.long))
    with pytest.raises(ConfigTypeError, match="config must be a MOPDLossConfig, got dict"):
        mopd_loss_func(micro, torch.zeros(B, L, 7), config={"is_cap": 2.0}, route_names=["r"])
    with pytest.raises(ConfigTypeError, match="config must be a MOPDConfig, got dict"):
        build_teacher_pool({"teachers": {}})
    assert MOPDLossConfig().is_cap == 5.0
