"""Megatron-Core side: a ``GPTModel`` teacher as a feature producer, and a student training step.

* :class:`MegatronTeacher` — a :data:`~shared_teacher.features.TeacherFeatureFn`: right-pads a
  batch of sequences, runs the frozen teacher once, returns per-sequence log-probs / top-k / hidden
  taps. Causal attention makes right padding exact: position ``t`` never sees ``> t``.
* :func:`collate` — student-side batching of features, unpacked (right-padded rows) or packed
  (one row, positions restarting per sample, block-diagonal causal mask): packing is a student
  choice; the source stores one object per sample either way.
* :func:`topk_distill_loss` — cross-entropy of the student to the renormalized teacher top-k
  (the demo objective; real objectives live in ``mopd``).
* :func:`train_window` — one optimizer step of a Megatron student on one window, through
  ``get_forward_backward_func``; features are read and fast-acked per micro-batch.

Only this module imports ``megatron.core``. The teacher must return full-vocabulary logits
(tensor-parallel size 1, or a model built with ``parallel_output=False``); pipeline size 1.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shared_teacher.config import CompatKey
from shared_teacher.features import features_from_logits, storage_dtype

__all__ = ["MegatronTeacher", "collate", "topk_distill_loss", "train_window", "export_hf_state_dict"]


class MegatronTeacher:
    """Frozen Megatron ``GPTModel`` → per-sequence features for ``key.signals``.

    Args:
        model: the teacher (``post_process=True``, full-vocab logits).
        key: the source's compatibility key (signals, top-k, hidden taps, dtype, max length).
        chunk: positions per log-softmax chunk.
    """

    def __init__(self, model: torch.nn.Module, *, key: CompatKey, chunk: int = 1024) -> None:
        self.model = model.eval()
        self.key = key
        self.chunk = chunk
        self.calls = 0
        self.sequences = 0

    def _layers(self):
        inner = self.model.module if hasattr(self.model, "module") else self.model
        return inner.decoder.layers

    @torch.no_grad()
    def __call__(self, sequences: list[torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """``sequences[i]``: int64 ``[L_i]`` (``L_i ≤ key.max_length``) → feature dicts (see features.py)."""
        key = self.key
        lengths = [int(s.numel()) for s in sequences]
        if max(lengths) > key.max_length:
            raise ValueError(f"sequence of {max(lengths)} tokens exceeds key.max_length={key.max_length}")
        device = next(self.model.parameters()).device
        b, s = len(sequences), max(lengths)
        tokens = torch.zeros(b, s, dtype=torch.int64, device=device)
        for i, seq in enumerate(sequences):
            tokens[i, : lengths[i]] = seq.to(device)
        position_ids = torch.arange(s, device=device).expand(b, s)
        taps: dict[int, torch.Tensor] = {}
        handles = []
        if "hidden" in key.signals:
            layers = self._layers()
            for layer in key.hidden_taps:
                if not 0 <= layer < len(layers):
                    raise ValueError(f"key.hidden_taps has layer {layer}, the teacher has {len(layers)} layers")

                def hook(_m, _inp, out, layer=layer):
                    hidden = out[0] if isinstance(out, tuple) else out
                    taps[layer] = hidden.transpose(0, 1)  # [S, B, H] -> [B, S, H]

                handles.append(layers[layer].register_forward_hook(hook))
        try:
            logits = self.model(tokens, position_ids, None)
        finally:
            for h in handles:
                h.remove()
        self.calls += 1
        self.sequences += b
        dtype = storage_dtype(key.dtype)
        feats = features_from_logits(logits, tokens, lengths, signals=key.signals, top_k=key.top_k, dtype=dtype,
                                     chunk=self.chunk)
        for layer, hidden in taps.items():
            for i, f in enumerate(feats):
                f[f"hidden.{layer}"] = hidden[i, : lengths[i]].to(dtype).cpu()
        return feats


def collate(features: list[dict[str, torch.Tensor]], *, packed: bool) -> dict[str, torch.Tensor]:
    """Batch sample features for a student forward.

    Unpacked: ``tokens/position_ids [B, S]`` right-padded, ``attention_mask None`` (causal).
    Packed: one row ``[1, T]`` (``T = Σ L_i``), positions restart at each sample, ``attention_mask``
    ``[1, 1, T, T]`` bool (True = masked) block-diagonal causal.
    Targets: ``topk_ids/topk_logprobs [B, S, k]``, ``loss_mask [B, S]`` (1 on real positions).
    """
    lengths = [int(f["tokens"].numel()) for f in features]
    k = features[0]["topk_ids"].shape[-1]
    if packed:
        t = sum(lengths)
        tokens = torch.cat([f["tokens"] for f in features])[None]
        position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
        seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
        return {"tokens": tokens, "position_ids": position_ids, "attention_mask": ~allowed[None, None],
                "topk_ids": torch.cat([f["topk_ids"] for f in features])[None],
                "topk_logprobs": torch.cat([f["topk_logprobs"] for f in features])[None].float(),
                "loss_mask": torch.ones(1, t)}
    b, s = len(features), max(lengths)
    out = {"tokens": torch.zeros(b, s, dtype=torch.int64), "position_ids": torch.arange(s).expand(b, s).contiguous(),
           "attention_mask": None, "topk_ids": torch.zeros(b, s, k, dtype=torch.int64),
           "topk_logprobs": torch.zeros(b, s, k), "loss_mask": torch.zeros(b, s)}
    for i, (f, n) in enumerate(zip(features, lengths)):
        out["tokens"][i, :n] = f["tokens"]
        out["topk_ids"][i, :n] = f["topk_ids"]
        out["topk_logprobs"][i, :n] = f["topk_logprobs"].float()
        out["loss_mask"][i, :n] = 1
    return out


def topk_distill_loss(student_logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss sum, token count)`` of ``−Σ_t Σ_k p̂_{t,k} log q_t(id_{t,k})``.

    ``student_logits [B, S, V]``; ``p̂ = softmax`` of the teacher's top-k log-probs (renormalized).
    """
    logq = torch.log_softmax(student_logits.float(), dim=-1).gather(-1, batch["topk_ids"])
    p = torch.softmax(batch["topk_logprobs"], dim=-1)
    per_pos = -(p * logq).sum(-1)
    mask = batch["loss_mask"]
    return (per_pos * mask).sum(), mask.sum()


def train_window(reader, window, model, optimizer, *, packed: bool,
                 loss_fn: Callable = topk_distill_loss) -> float:
    """One optimizer step of a Megatron student on ``window`` (DDP-wrapped ``model``, PP=1).

    Reads each micro-batch from the store inside ``forward_step`` and fast-acks it; the caller
    durable-acks with ``reader.ack_step(window)`` after this returns. Returns the mean loss.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro = iter(enumerate(window.micro_batches))

    def forward_step(_it, m):
        idx, refs = next(micro)
        feats = reader.load(refs)
        reader.ack_read(window, idx)
        batch = collate(feats, packed=packed)
        logits = m(batch["tokens"], batch["position_ids"], batch["attention_mask"])

        def finish(out):
            total, count = loss_fn(out, batch)
            loss = total / count.clamp_min(1)
            return loss, {"loss": loss.detach()}

        return logits, finish

    if hasattr(model, "zero_grad_buffer"):
        model.zero_grad_buffer()
    optimizer.zero_grad()
    steps = len(window.micro_batches)
    longest = max(max(int(r.num_tokens) for r in mb) for mb in window.micro_batches)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None] * steps), model=[model], num_microbatches=steps,
        seq_length=longest, micro_batch_size=1, forward_only=False)
    optimizer.step()
    return float(sum(d["loss"] for d in losses) / max(len(losses), 1))


def export_hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Qwen3-style Hugging Face names for a local-spec Megatron ``GPTModel`` (TP=1, PP=1, dense).

    Fused ``linear_qkv`` is split into ``q_proj/k_proj/v_proj`` (GQA layout: per query group,
    ``heads/groups`` q heads then one k and one v head); ``linear_fc1`` into ``gate_proj/up_proj``.
    """
    inner = model.module if hasattr(model, "module") else model
    cfg = inner.config
    sd = {k: v for k, v in inner.state_dict().items() if isinstance(v, torch.Tensor) and "_extra_state" not in k}
    heads, groups = cfg.num_attention_heads, cfg.num_query_groups
    d = cfg.kv_channels
    per = heads // groups
    out = {"model.embed_tokens.weight": sd["embedding.word_embeddings.weight"],
           "model.norm.weight": sd["decoder.final_layernorm.weight"]}
    if "output_layer.weight" in sd:
        out["lm_head.weight"] = sd["output_layer.weight"]
    for i in range(cfg.num_layers):
        p, q = f"decoder.layers.{i}.", f"model.layers.{i}."
        qkv = sd[p + "self_attention.linear_qkv.weight"].view(groups, per + 2, d, -1)
        out[q + "self_attn.q_proj.weight"] = qkv[:, :per].reshape(heads * d, -1)
        out[q + "self_attn.k_proj.weight"] = qkv[:, per].reshape(groups * d, -1)
        out[q + "self_attn.v_proj.weight"] = qkv[:, per + 1].reshape(groups * d, -1)
        out[q + "self_attn.o_proj.weight"] = sd[p + "self_attention.linear_proj.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        if p + "self_attention.q_layernorm.weight" in sd:
            out[q + "self_attn.q_norm.weight"] = sd[p + "self_attention.q_layernorm.weight"]
            out[q + "self_attn.k_norm.weight"] = sd[p + "self_attention.k_layernorm.weight"]
        gate, up = sd[p + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out[q + "mlp.gate_proj.weight"] = gate
        out[q + "mlp.up_proj.weight"] = up
        out[q + "mlp.down_proj.weight"] = sd[p + "mlp.linear_fc2.weight"]
        out[q + "post_attention_layernorm.weight"] = sd[p + "pre_mlp_layernorm.weight"]
    return {k: v.detach().clone().contiguous() for k, v in out.items()}
