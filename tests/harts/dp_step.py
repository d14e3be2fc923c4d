"""A full data-parallel training step with harts inside Megatron's own machinery, for the
multirank test: DP=2 Megatron DDP + ``get_forward_backward_func`` over planner microbatches,
rows exchanged between ranks, loss normalized over global per-sequence counts; the reduced
gradients must equal the gradient of the same objective computed per sequence on the whole batch.
"""

from __future__ import annotations

import torch

VOCAB = 61


def _loss_terms(lp, ent, old, adv, seq_ids):
    from harts.loss import ppo_clip_token_loss

    return ppo_clip_token_loss(lp, old, adv[seq_ids], clip_low=0.2, clip_high=0.28) - 0.01 * ent


def dp_step_body(rank, world):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from harts.config import PlannerConfig
    from harts.exchange import RowExchange, gather_sequences
    from harts.loss import aggregate_loss, sequence_entropy, sequence_logprobs
    from harts.megatron import apply_harts, tree_forward
    from harts.planner import plan_step
    from harts.workload import grpo_groups
    from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, init_megatron, seed_all

    init_megatron(tp=1)  # DP = world
    dp_group = parallel_state.get_data_parallel_group()
    cfg = TinyGPTConfig(vocab_size=VOCAB, params_dtype=torch.float64)
    seed_all(11)
    model = build_tiny_gpt(cfg).double()
    seed_all(11)
    ref_model = build_tiny_gpt(cfg).double()  # same weights, no DDP: the per-sequence oracle
    apply_harts(model)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(overlap_grad_reduce=False), model)

    # each rank owns different rollouts with different per-row data
    local = grpo_groups(1 + rank, prompt_len=6, response_len=3, n=3, vocab_size=VOCAB, seed=rank, response_jitter=2)
    g = torch.Generator().manual_seed(100 + rank)
    local_adv = torch.randn(len(local), generator=g, dtype=torch.float64)
    local_old = torch.cat([-3.0 - torch.rand(len(s) - 1, generator=g, dtype=torch.float64) for s in local])

    seqs, counts = gather_sequences(local, group=dp_group)
    seqs = [s.tolist() for s in seqs]
    plan = plan_step(seqs, PlannerConfig(token_cap=16, align=1, fallback_compression=1.3, dp_size=world))
    ex = RowExchange(plan, counts, group=dp_group)
    pred_lens = torch.tensor([len(s) - 1 for s in seqs])
    adv_rows = ex.to_plan(local_adv)
    old_rows = ex.to_plan(local_old, lengths=pred_lens)
    n_seq_global = float(len(seqs))
    mbs = plan.ranks[rank]
    num_mb = len(mbs)

    # slice this rank's per-row tensors per microbatch (rows are in plan order)
    batches, r0, t0 = [], 0, 0
    for mb in mbs:
        n = len(mb.seq_ids)
        nt = int(pred_lens[mb.seq_ids].sum())
        batches.append((mb.build(seqs), adv_rows[r0:r0 + n], old_rows[t0:t0 + nt]))
        r0, t0 = r0 + n, t0 + nt

    def forward_step(data_iterator, model_):
        forest, adv, old = next(data_iterator)
        out = tree_forward(model_, forest, backend="dense", chunk_size=5, entropy_requires_grad=True)

        def loss_func(output):
            lp, ent = sequence_logprobs(output[0], forest), sequence_entropy(output[1], forest)
            ids = forest.pred_seq_ids()
            tok = _loss_terms(lp, ent, old, adv, ids)
            loss = aggregate_loss(tok, torch.ones_like(tok), ids, num_seqs=forest.num_seqs, mode="seq_mean",
                                  num_sequences=n_seq_global)
            # Megatron divides by num_microbatches and DDP averages over DP: undo both so the
            # reduced gradient is that of the global objective
            return loss * num_mb * world, {"loss": loss.detach()}

        return out, loss_func

    ddp.zero_grad_buffer()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
                                num_microbatches=num_mb, seq_length=16, micro_batch_size=1, forward_only=False)
    ddp.finish_grad_sync()

    # oracle: every sequence alone, global objective, on the un-wrapped twin
    # the oracle needs every rank's per-row data (counts differ per rank: gather padded)
    mx = max(counts)
    pa = [torch.zeros(mx, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(pa, torch.nn.functional.pad(local_adv, (0, mx - len(local))), group=dp_group)
    all_adv = torch.cat([p[:c] for p, c in zip(pa, counts)])
    mt = int(max(pred_lens[sum(counts[:r]):sum(counts[:r + 1])].sum() for r in range(world)))
    po = [torch.zeros(mt, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(po, torch.nn.functional.pad(local_old, (0, mt - len(local_old))), group=dp_group)
    all_old = torch.cat([po[r][: int(pred_lens[sum(counts[:r]):sum(counts[:r + 1])].sum())] for r in range(world)])
    lps, ents = [], []
    for s in seqs:
        t = torch.tensor(s)
        causal = torch.triu(torch.ones(len(s), len(s), dtype=torch.bool), diagonal=1)[None, None]
        lp = torch.log_softmax(ref_model(t[None], torch.arange(len(s))[None], causal)[0], -1)[:-1]
        lps.append(lp.gather(-1, t[1:, None]).squeeze(-1))
        ents.append(-(lp.exp() * lp).sum(-1))
    ids = torch.repeat_interleave(torch.arange(len(seqs)), pred_lens)
    tok = _loss_terms(torch.cat(lps), torch.cat(ents), all_old, all_adv, ids)
    aggregate_loss(tok, torch.ones_like(tok), ids, num_seqs=len(seqs), mode="seq_mean").backward()
    checked = 0
    for (name, p), (_, pr) in zip(model.named_parameters(), ref_model.named_parameters()):
        assert pr.grad is not None and pr.grad.abs().max() > 0, name
        assert_close(f"dp grad {name}", pr.grad, p.main_grad, atol=1e-10, rtol=1e-10)
        checked += 1
    parallel_state.destroy_model_parallel()
    return checked, num_mb
