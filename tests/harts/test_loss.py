"""Loss normalization over original per-sequence token counts, across microbatches."""

from __future__ import annotations

import pytest
import torch

from harts.forest import build_forest
from harts.loss import aggregate_loss, global_normalizers, ppo_clip_token_loss, sequence_logprobs
from mcore_distill.testing import assert_close


def _batch():
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9, 3, 7]  # prediction positions per sequence (one with a single position)
    ids = torch.repeat_interleave(torch.arange(5), torch.tensor(lens))
    loss = torch.randn(int(sum(lens)), generator=g, dtype=torch.float64)
    mask = (torch.rand(loss.shape, generator=g) > 0.3).double()
    mask[ids == 1] = 0.0  # a sequence without loss tokens
    return loss, mask, ids


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean", "seq_mean_token_sum"])
def test_microbatch_split_with_global_normalizers(mode):
    loss, mask, ids = _batch()
    whole = aggregate_loss(loss, mask, ids, num_seqs=5, mode=mode)
    # hand-computed
    per = [(loss[ids == i] * mask[ids == i]).sum() for i in range(5)]
    cnt = [mask[ids == i].sum() for i in range(5)]
    valid = [i for i in range(5) if cnt[i] > 0]
    expect = {"token_mean": sum(per) / sum(cnt),
              "seq_mean": sum(per[i] / cnt[i] for i in valid) / len(valid),
              "seq_mean_token_sum": sum(per) / len(valid)}[mode]
    assert_close("whole", torch.as_tensor(expect), whole, atol=1e-14, rtol=1e-14)
    # two microbatches (sequences 0-1 and 2-4) with the global denominators sum to the same value
    ntok, nseq = global_normalizers(mask, ids, num_seqs=5)
    assert (ntok, nseq) == (float(sum(cnt)), 4.0)
    parts = []
    for sel in ([0, 1], [2, 3, 4]):
        m = torch.isin(ids, torch.tensor(sel))
        remap = ids[m] - sel[0]
        parts.append(aggregate_loss(loss[m], mask[m], remap, num_seqs=len(sel), mode=mode, num_tokens=ntok,
                                    num_sequences=nseq))
    assert_close("split", whole, sum(parts), atol=1e-14, rtol=1e-14)


def test_fork_gradients_sum_at_shared_row():
    """Gathering by index sends every sequence's gradient into the shared compact row."""
    f = build_forest([[1, 2, 3], [1, 2, 4], [1, 2, 3]])
    node = torch.zeros(f.num_nodes, dtype=torch.float64, requires_grad=True)
    lp = sequence_logprobs(node, f)
    assert lp.numel() == 6
    (lp * torch.arange(1.0, 7.0, dtype=torch.float64)).sum().backward()
    # node 1 (token 2) is position 1 of all three sequences: weights 1 + 3 + 5
    assert node.grad[1].item() == 9.0 and node.grad[0].item() == 0.0


def test_ppo_clip_and_bad_mode():
    lp, old, adv = torch.tensor([0.0, 0.5]), torch.tensor([0.0, 0.0]), torch.tensor([1.0, 1.0])
    out = ppo_clip_token_loss(lp, old, adv, clip_low=0.2, clip_high=0.2)
    assert_close("ppo", torch.tensor([-1.0, -1.2]), out, atol=1e-6)
    with pytest.raises(ValueError, match="mode must be"):
        aggregate_loss(lp, adv, torch.zeros(2, dtype=torch.int64), num_seqs=1, mode="sum")
