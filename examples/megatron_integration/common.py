"""What ``plain.py`` and ``train.py`` share and what a Megatron trainer already has: process groups,
the model provider, a synthetic data set, a per-step log, and a sampler standing in for the rollout
engine (an RL trainer has SGLang or vLLM for that).

Task: reverse ``LETTERS`` letters. A row is ``BOS x_1..x_n SEP x_n..x_1``: a prompt of
``PROMPT = n + 2`` tokens and an answer of ``n`` tokens; the loss covers the answer.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_distill import cpu_compat
from mcore_distill.hf import megatron_model_from_hf, save_hf_checkpoint
from mcore_distill.lifetime import end_with_launcher

LETTERS, ALPHABET, VOCAB = 4, 16, 32  # token ids 3..18 are letters; 0 pad, 1 BOS, 2 SEP
BOS, SEP = 1, 2
PROMPT = LETTERS + 2
SEQ = PROMPT + LETTERS


def parse_args(description: str, extra=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (the rest of the ranks is DP)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--batch", type=int, default=32, help="sequences per data-parallel rank and step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default=None, help="checkpoint folder written at the end")
    ap.add_argument("--hf", default=None, help="start the model from this Hugging Face folder (config.json + "
                    "safetensors, e.g. one written by --save-hf) instead of a random init")
    ap.add_argument("--save-hf", default=None, help="also write the trained model as a Hugging Face folder")
    ap.add_argument("--out", default=None, help="write the per-step losses as JSON here (rank 0)")
    if extra is not None:
        extra(ap)
    return ap.parse_args()


def initialize_distributed(tp: int, seed: int) -> None:
    """torchrun's process group (gloo on CPU through ``cpu_compat``, NCCL on CUDA) and Megatron's
    model-parallel groups, seeded; the rank ends if torchrun is killed (``end_with_launcher``)."""
    end_with_launcher()
    cpu_compat.enable()  # a no-op on a CUDA machine
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def model_provider(hf: str | None = None) -> GPTModel:
    """A small Qwen3-style Megatron GPT (RMSNorm, SwiGLU, GQA, RoPE, qk-norm) on this rank's device:
    random, or with ``hf`` the model of that Hugging Face folder, shapes from its ``config.json``,
    weights loaded into this rank's TP shard (:func:`mcore_distill.hf.megatron_model_from_hf`)."""
    if hf is not None:  # no vocabulary padding: the HF vocabulary is the model's
        model = megatron_model_from_hf(hf, make_vocab_size_divisible_by=1, attention_dropout=0.0,
                                       hidden_dropout=0.0)[0]
        return model.cuda() if torch.cuda.is_available() else model
    config = TransformerConfig(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, qk_layernorm=True, layernorm_epsilon=1e-6, init_method_std=0.02,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        attention_dropout=0.0, hidden_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True,
                                                                                     normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=SEQ, position_embedding_type="rope")
    return model.cuda() if torch.cuda.is_available() else model


def data_generator(seed: int) -> torch.Generator:
    """One stream per data-parallel rank (tensor-parallel ranks of a group draw the same data)."""
    return torch.Generator().manual_seed(1000 * seed + parallel_state.get_data_parallel_rank())


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def position_ids(tokens: torch.Tensor) -> torch.Tensor:
    return torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)


def get_batch(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``n`` rows in Megatron's batch layout: ``tokens``, ``labels`` (tokens shifted left),
    ``loss_mask`` (1 where the label is an answer token) and ``position_ids``, all ``[n, SEQ]``."""
    x = torch.randint(3, 3 + ALPHABET, (n, LETTERS), generator=gen)
    tokens = torch.cat([torch.full((n, 1), BOS), x, torch.full((n, 1), SEP), x.flip(1)], 1).to(_device())
    loss_mask = torch.zeros(n, SEQ, device=tokens.device)
    loss_mask[:, PROMPT - 1:SEQ - 1] = 1.0
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, 1), "loss_mask": loss_mask,
            "position_ids": position_ids(tokens)}


@torch.no_grad()
def sample(model: torch.nn.Module, prompts: torch.Tensor, n_new: int, gen: torch.Generator,
           temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Stand-in for the rollout engine: ``n_new`` tokens sampled per prompt at ``temperature``.

    Returns ``tokens [B, P + n_new]`` and the behaviour log-probs ``old_logp [B, P + n_new]`` in
    Megatron's label layout (``old_logp[:, t]`` scores ``tokens[:, t + 1]``; 0 before the answer).
    Tensor-parallel ranks gather the full vocabulary and draw the same tokens."""
    tokens = prompts
    old = torch.zeros(prompts.shape[0], prompts.shape[1] + n_new, device=prompts.device)
    for t in range(prompts.shape[1] - 1, prompts.shape[1] + n_new - 1):
        logits = model(tokens, position_ids(tokens), None, runtime_gather_output=True)[:, -1].float()
        logp = torch.log_softmax(logits / temperature, -1)
        nxt = torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(tokens.device)
        old[:, t] = logp.gather(-1, nxt)[:, 0]
        tokens = torch.cat([tokens, nxt], 1)
    return tokens, old


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, n: int = 256, seed: int = 123) -> float:
    """Exact-match rate of greedy answers on ``n`` held-out prompts (the same on every rank)."""
    rows = get_batch(n, torch.Generator().manual_seed(seed))["tokens"]
    tokens = rows[:, :PROMPT]
    for _ in range(LETTERS):
        logits = model(tokens, position_ids(tokens), None, runtime_gather_output=True)[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], 1)
    return float((tokens == rows).all(1).float().mean())


class StepLog:
    """Per-step metrics of ``forward_backward_func``'s output (last pipeline stage), averaged over
    micro-batches and data-parallel ranks; rank 0 prints them and writes ``--out`` at the end."""

    SHOW = ("lm loss", "mopd/loss", "mopd/reward", "mopd/is_capped_frac")

    def __init__(self, out: str | None, save_hf: str | None = None) -> None:
        self.out, self.save_hf, self.rows = out, save_hf, []

    def step(self, step: int, losses: list[dict[str, torch.Tensor]]) -> None:
        keys = sorted(losses[0]) if losses else []
        sums = torch.zeros(2 * len(keys), dtype=torch.float64)
        for m in losses:
            for i, k in enumerate(keys):
                v = m[k].detach().double().reshape(-1).cpu()
                sums[2 * i:2 * i + 2] += v if v.numel() == 2 else torch.stack([v[0], v.new_ones(())])
        dist.all_reduce(sums, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        row = {"step": step, **{k: float(sums[2 * i] / sums[2 * i + 1]) for i, k in enumerate(keys)}}
        self.rows.append(row)
        if dist.get_rank() == 0:
            print(f"step {step:3d}  " + "  ".join(f"{k} {row[k]:.5f}" for k in self.SHOW if k in row), flush=True)

    def close(self, model: torch.nn.Module) -> None:
        """Print the held-out greedy accuracy, write ``--out`` and ``--save-hf`` (collective), end
        the process group."""
        if self.save_hf:
            save_hf_checkpoint([model.module], self.save_hf, model_type="qwen3", vocab_size=VOCAB)
        acc = greedy_accuracy(model)
        self.rows.append({"held_out_accuracy": acc})
        if dist.get_rank() == 0:
            print(f"held-out exact match (greedy, {LETTERS} letters): {acc:.1%}", flush=True)
        if self.out and dist.get_rank() == 0:
            with open(self.out, "w") as f:
                json.dump(self.rows, f, indent=1)
        dist.destroy_process_group()
