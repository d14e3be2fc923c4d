"""Rank bodies of the multi-rank HF checkpoint tests (module level, so spawn can import them)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def megatron_logits(chunks, tokens: torch.Tensor, vocab: int) -> torch.Tensor | None:
    """Full-vocabulary logits ``[B, L, vocab]`` on the last pipeline stage (None elsewhere):
    Megatron's forward-only schedule, vocab-parallel outputs gathered over TP, padding dropped."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    B, L = tokens.shape

    def step(data, model):
        t = next(data)
        out = model(t, torch.arange(L).expand_as(t), None)

        def collect(output, non_loss_data=True):
            return output

        return out, collect

    res = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]), model=chunks[0],
                                      num_microbatches=1, seq_length=L, micro_batch_size=B, forward_only=True,
                                      collect_non_loss_data=True)
    if not ps.is_pipeline_last_stage():
        return None
    out = res[0].contiguous()
    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, out, group=group)
    return torch.cat(parts, dim=-1)[..., :vocab]


def load_save_load(rank: int, world_size: int, cases: list[dict]) -> list[dict]:
    """For each case: ``megatron_model_from_hf`` at (tp, pp, ep, etp), logits; ``save_hf_checkpoint``
    into ``case["out"]``; load that folder into a fresh model: every parameter bitwise equal."""
    from megatron.core import parallel_state as ps

    from mcore_distill.hf import megatron_model_from_hf, save_hf_checkpoint
    from mcore_distill.testing import seed_all

    from .models import VOCAB, use_torch_gdn

    use_torch_gdn()
    results = []
    for case in cases:
        ps.initialize_model_parallel(tensor_model_parallel_size=case.get("tp", 1),
                                     pipeline_model_parallel_size=case.get("pp", 1),
                                     expert_model_parallel_size=case.get("ep", 1),
                                     expert_tensor_parallel_size=case.get("etp"))
        seed_all(3)
        try:
            chunks = megatron_model_from_hf(case["path"])
            for c in chunks:
                c.eval()
            with torch.no_grad():
                logits = megatron_logits(chunks, case["tokens"], VOCAB)
            report = save_hf_checkpoint(chunks, case["out"], max_shard_bytes=case.get("max_shard_bytes", 5 << 30))
            again = megatron_model_from_hf(case["out"])
            first = dict(chunks[0].named_parameters())
            bitwise = all(torch.equal(first[n], p) for n, p in again[0].named_parameters())
            results.append({"id": case["id"], "logits": logits, "bitwise": bitwise, "files": report.files,
                            "params": len(first), "vocab_rows": chunks[0].vocab_size})
        finally:
            ps.destroy_model_parallel()
    return results
