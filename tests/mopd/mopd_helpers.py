"""Small real models and batches shared by the mopd tests."""

from __future__ import annotations

import torch

from mopd.backends import TokenBatch


def tiny_qwen3(seed: int, *, vocab: int = 48, hidden: int = 32, layers: int = 1):
    """A real transformers Qwen3 causal LM with random weights (fp32, eval)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=64,
                      tie_word_embeddings=False, rope_theta=10000.0)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights so teachers differ visibly
        model.lm_head.weight.mul_(20.0)
    return model


def token_batch(B: int, L: int, *, vocab: int = 48, seed: int = 0, score_from: bool = False) -> TokenBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, L), generator=g)
    lengths = torch.randint(max(2, L // 2), L + 1, (B,), generator=g)
    lengths[0] = L
    for b in range(B):
        ids[b, lengths[b]:] = 0
    sf = torch.randint(0, 3, (B,), generator=g) if score_from else None
    return TokenBatch(ids, lengths, sf)


def reference_logp(model, batch: TokenBatch, temperature: float = 1.0) -> torch.Tensor:
    """Row-by-row, unpadded: logp[b, t] = log softmax(z_t / τ)[ids[t+1]] on label positions."""
    B, L = batch.input_ids.shape
    out = torch.zeros(B, L, dtype=torch.float64)
    with torch.no_grad():
        for b in range(B):
            n = int(batch.lengths[b])
            row = batch.input_ids[b, :n]
            z = model(input_ids=row[None]).logits[0].double()
            lp = torch.log_softmax(z / temperature, -1)
            start = 0 if batch.score_from is None else int(batch.score_from[b])
            for t in range(start, n - 1):
                out[b, t] = lp[t, row[t + 1]]
    return out
