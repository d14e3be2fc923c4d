"""Pipeline parallelism (PP=2, gloo) with Megatron's own schedule: tree microbatches of variable
length (``variable_seq_lengths=True``) vs the same sequences as per-sequence microbatches through
the same pipeline; per-stage parameter gradients of one global PPO objective must agree."""

from __future__ import annotations

import torch

VOCAB = 61


def _objective(lp, ent, old, adv, ids, n_total):
    from harts.loss import aggregate_loss, ppo_clip_token_loss

    tok = ppo_clip_token_loss(lp, old, adv[ids]) - 0.01 * ent
    return aggregate_loss(tok, torch.ones_like(tok), ids, num_seqs=int(adv.numel()), mode="seq_mean",
                          num_sequences=n_total)


def pp_step_body(rank, world):
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from harts.forest import build_forest
    from harts.loss import sequence_entropy, sequence_logprobs
    from harts.megatron import apply_harts, tree_forward
    from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, init_megatron, seed_all

    init_megatron(pp=world)
    cfg = TinyGPTConfig(vocab_size=VOCAB, params_dtype=torch.float64, pipeline_model_parallel_size=world,
                        extra={"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"})
    seed_all(3)
    model = build_tiny_gpt(cfg).double()
    apply_harts(model)
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 3, 8, 9], [1, 2, 3, 4, 5, 6], [1, 2], [9, 9, 9],
            [30, 40, 50, 60], [30, 40, 51]]
    g = torch.Generator().manual_seed(9)
    adv = torch.randn(len(seqs), generator=g, dtype=torch.float64)
    old = [-3.0 - torch.rand(len(s) - 1, generator=g, dtype=torch.float64) for s in seqs]
    groups = [[0, 1, 2, 3, 4], [5, 6, 7]]  # two tree microbatches
    fb = get_forward_backward_func()

    def run(batches, fwd):
        model.zero_grad(set_to_none=True)
        fb(forward_step_func=fwd, data_iterator=iter(batches), model=[model], num_microbatches=len(batches),
           seq_length=1, micro_batch_size=1, forward_only=False)
        return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}

    def tree_step(it, m):
        ids_ = next(it)
        f = build_forest([seqs[i] for i in ids_])
        out = tree_forward(m, f, backend="dense", chunk_size=4, entropy_requires_grad=True)

        def loss_func(o):
            sid = f.pred_seq_ids()
            lp, ent = sequence_logprobs(o[0], f), sequence_entropy(o[1], f)
            loss = _objective(lp, ent, torch.cat([old[i] for i in ids_]), adv[ids_], sid, float(len(seqs)))
            return loss * len(groups), {}

        return out, loss_func

    def seq_step(it, m):
        i = next(it)
        t = torch.tensor(seqs[i])
        causal = torch.triu(torch.ones(len(t), len(t), dtype=torch.bool), diagonal=1)[None, None]
        out = m(t[None], torch.arange(len(t))[None], causal)

        def loss_func(logits):
            lp = torch.log_softmax(logits[0], -1)[:-1]
            tok_lp = lp.gather(-1, t[1:, None]).squeeze(-1)
            ent = -(lp.exp() * lp).sum(-1)
            ids = torch.zeros(len(t) - 1, dtype=torch.int64)
            loss = _objective(tok_lp, ent, old[i], adv[i:i + 1], ids, float(len(seqs)))
            return loss * len(seqs), {}

        return out, loss_func

    g_tree = run(groups, tree_step)
    g_ref = run(list(range(len(seqs))), seq_step)
    assert set(g_tree) == set(g_ref) and g_ref
    for name, ref in g_ref.items():
        assert ref.abs().max() > 0, name
        assert_close(f"pp grad {name}", ref, g_tree[name], atol=1e-10, rtol=1e-10)
    parallel_state.destroy_model_parallel()
    return len(g_ref)
