"""Microbatch planning needs no device synchronization: it reads only host copies of the forest
and moves its index arrays to the device in one non-blocking transfer per plan.

The proof on CPU: the forest's tensors live on the ``meta`` device, which has no data, so any
read of a device value during planning (``.cpu()``, ``.item()``, ``.tolist()``, ``int(t)``, a
boolean mask) raises; planning must still succeed. Host-to-device copies are counted by
wrapping :func:`harts.upload.upload` (on CUDA each is one pinned, non-blocking copy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import harts.forest
import harts.gdn
import harts.megatron
import harts.varlen
from harts.forest import build_forest
from harts.gdn import GdnTreeConfig, _chunk_indices, build_gdn_plan
from harts.lm_head import head_edges
from harts.workload import caterpillar, grpo_groups


def _seqs():
    return grpo_groups(2, prompt_len=150, response_len=70, n=4, vocab_size=500, seed=3) + \
        caterpillar(1, turns=3, turn_len=40, branches=2, branch_len=30, vocab_size=500, seed=4)


@pytest.fixture
def uploads(monkeypatch):
    """Count host-to-device transfers of the planning code."""
    calls = []
    real = harts.upload.upload

    def counted(arrays, device):
        calls.append(len(arrays))
        return real(arrays, device)

    for mod in (harts.forest, harts.varlen, harts.gdn, harts.megatron):
        monkeypatch.setattr(mod, "upload", counted)
    return calls


def test_gpt_and_gdn_plans_read_no_device_data(uploads):
    from harts.gdn_megatron import make_gdn_tree_params

    forest = build_forest(_seqs(), device="meta").padded(16)
    assert forest.tokens.device.type == "meta" and forest.host is not None
    assert len(uploads) == 2  # the forest, then its padding rows
    uploads.clear()
    for cfg in (GdnTreeConfig(), GdnTreeConfig(schedule="chain"), GdnTreeConfig(align=False)):
        params = make_gdn_tree_params(forest, config=cfg, backend="varlen")
        assert params.gdn_plan.num_rounds >= 2 and params.varlen_plan.kv_index.device.type == "meta"
        assert params.head_edges.child.device.type == "meta" and params.max_token == max(map(max, _seqs()))
    # per microbatch: one transfer each for the attention plan, the head's edges and the GDN plan
    assert len(uploads) == 3 * 3
    uploads.clear()
    harts.megatron.make_tree_params(forest, backend="varlen", varlen_mode="levels")
    assert len(uploads) == 2
    with pytest.raises(NotImplementedError):  # the check can fail: reading a meta tensor's values raises
        forest.parent.cpu().numpy()


def test_host_plans_equal_device_plans():
    """Plans built from the host copies equal plans built by copying the device tensors back (a
    forest without host copies, as `Forest(...)` made from tensors has)."""
    import dataclasses

    from harts.varlen import build_varlen_plan

    f = build_forest(_seqs()).padded(16)
    g = dataclasses.replace(f, host=None)
    for a, b in ((build_gdn_plan(f), build_gdn_plan(g)), (build_gdn_plan(f, schedule="chain"),
                                                        build_gdn_plan(g, schedule="chain"))):
        assert a.num_rounds == b.num_rounds and torch.equal(a.inverse, b.inverse) and torch.equal(a.anc, b.anc)
        for x, y in zip(a.rounds, b.rounds):
            assert torch.equal(x.rows, y.rows) and torch.equal(x.keep, y.keep) and torch.equal(x.cu_seqlens, y.cu_seqlens)
            assert torch.equal(x.chunk_indices, y.chunk_indices)
    for mode in ("gather", "levels"):
        a = build_varlen_plan(f.host["seg_offsets"], f.host["seg_parent"], mode=mode)
        b = build_varlen_plan(f.seg_offsets, f.seg_parent, mode=mode)
        for name in ("cu_q", "cu_k", "kv_index", "copy_ptr", "copy_pos"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None and y is None) or (x.dtype == y.dtype and torch.equal(x, y)), name
    e, r = harts.megatron._head_edges_host(f.tokens, f.host["parent"]), head_edges(f.tokens, f.parent)
    assert e.offsets == r.offsets and all(torch.equal(getattr(e, k), getattr(r, k)) for k in ("child", "parent", "token"))


def test_chunk_indices_equal_fla():
    """The plan's per-round chunk indices (handed to FLA so its kernels never rebuild them) equal
    FLA's own ``prepare_chunk_indices``."""
    index = pytest.importorskip("fla.ops.utils.index")
    for cu in ([0, 1, 64, 65, 200, 330], [0, 64, 128], [0, 5]):
        c = np.array(cu)
        for chunk in (16, 64):
            ref = index.prepare_chunk_indices(torch.tensor(cu), chunk)
            assert torch.equal(torch.from_numpy(_chunk_indices(c, chunk)), ref), (cu, chunk)
    plan = build_gdn_plan(build_forest(_seqs()))
    for rd in plan.rounds:
        assert torch.equal(rd.chunk_indices, index.prepare_chunk_indices(rd.cu_seqlens.clone(), 64))
    assert torch.equal(plan.conv_chunk_indices, index.prepare_chunk_indices(plan.conv_cu_seqlens.clone(), 64))
