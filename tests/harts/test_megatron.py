"""Tree execution of the real tiny Megatron GPT equals per-sequence execution (fp64 on CPU):
per-sequence log-probs, entropies, a PPO-style clipped loss and every parameter gradient."""

from __future__ import annotations

import pytest
import torch

from harts.forest import build_forest
from harts.loss import aggregate_loss, ppo_clip_token_loss, sequence_entropy, sequence_logprobs
from mcore_distill.testing import TinyGPTConfig, assert_close, build_tiny_gpt, seed_all
from tests.harts.cases import CASES

VOCAB = 61  # odd on purpose


def _objective(lp, ent, seq_ids, num_seqs, old, adv, mode):
    tok = ppo_clip_token_loss(lp, old, adv[seq_ids], clip_low=0.2, clip_high=0.28) - 0.01 * ent
    return aggregate_loss(tok, torch.ones_like(tok), seq_ids, num_seqs=num_seqs, mode=mode)


def _per_sequence(model, seqs, device="cpu"):
    lps, ents = [], []
    for s in seqs:
        t = torch.tensor(s, device=device)
        # Megatron's own causal mask (attention_mask=None): the per-sequence reference runs unmodified
        logits = model(t[None], torch.arange(len(s), device=device)[None], None, runtime_gather_output=True)[0]  # [L, V]
        lp = torch.log_softmax(logits.double(), -1)[:-1]
        lps.append(lp.gather(-1, t[1:, None]).squeeze(-1))
        ents.append(-(lp.exp() * lp).sum(-1))
    return torch.cat(lps), torch.cat(ents)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def run_exactness(seqs, *, dtype, recompute, mode="seq_mean", chunk_size=3, tie=False, tol, grad_tol=None,
                  device="cpu", backend="dense", varlen_mode="auto", **model_kw):
    """Shared by the 1-rank test, the TP=2 rank body and the GPU lane."""
    grad_tol = tol if grad_tol is None else grad_tol
    from harts.megatron import apply_harts, make_tree_params, tree_forward

    seed_all(1234)
    cfg = TinyGPTConfig(vocab_size=VOCAB + (VOCAB % 2 if torch.distributed.get_world_size() > 1 else 0),
                        params_dtype=dtype, recompute=recompute, tie_embeddings=tie,
                        tensor_model_parallel_size=torch.distributed.get_world_size(), **model_kw)
    model = build_tiny_gpt(cfg).to(device=device, dtype=dtype)  # the torch-norm fallback keeps norm weights in fp32 otherwise
    apply_harts(model)
    forest = build_forest(seqs, vocab_size=VOCAB, device=device).padded(torch.distributed.get_world_size())
    n = len(seqs)
    g = torch.Generator().manual_seed(7)
    adv = torch.randn(n, generator=g, dtype=torch.float64).to(device)
    seq_ids = forest.pred_seq_ids()

    params = make_tree_params(forest, backend=backend, varlen_mode=varlen_mode)
    out = tree_forward(model, forest, params=params, backend=backend, chunk_size=chunk_size,
                       entropy_requires_grad=True)
    lp, ent = sequence_logprobs(out.logp, forest), sequence_entropy(out.entropy, forest)
    old = (lp.detach() + 0.1 * torch.randn(lp.shape, generator=g, dtype=torch.float64).to(device)).to(lp.dtype)
    loss = _objective(lp, ent, seq_ids, n, old, adv.to(lp.dtype), mode)
    loss.backward()
    g_tree = _grads(model)
    model.zero_grad(set_to_none=True)

    lp_r, ent_r = _per_sequence(model, seqs, device)
    loss_r = _objective(lp_r.to(lp.dtype), ent_r.to(lp.dtype), seq_ids, n, old, adv.to(lp.dtype), mode)
    loss_r.backward()
    g_ref = _grads(model)

    assert_close("logp", lp_r, lp, atol=tol, rtol=tol)
    assert_close("entropy", ent_r, ent, atol=tol, rtol=tol)
    assert_close("loss", loss_r, loss, atol=tol, rtol=tol)
    assert set(g_tree) == set(g_ref) and len(g_ref) > 0
    for name, ref in g_ref.items():
        assert ref.abs().max() > 0, f"{name}: zero reference gradient makes the check vacuous"
        assert_close(f"grad {name}", ref, g_tree[name], atol=grad_tol, rtol=grad_tol)
    return len(g_ref)


def _varlen_bf16_errors(device: str, save_gathered_kv: bool) -> dict[str, tuple[float, float]]:
    """The tiny GPT (GQA 4:2, full recomputation) in bf16 through the varlen backend, as a prefix
    forest (gather plan) and as THD packing (chain forest, same kernels), each against fp32
    per-sequence execution of the same weights: ``{name: (tree error, THD error)}`` for the
    per-token log-probs (max abs) and every parameter gradient (relative Frobenius)."""
    from harts.forest import build_chain_forest
    from harts.megatron import apply_harts, make_tree_params, tree_forward
    from harts.workload import caterpillar, grpo_groups

    seqs = grpo_groups(2, prompt_len=150, response_len=70, n=4, vocab_size=500, seed=3) + \
        caterpillar(1, turns=3, turn_len=40, branches=2, branch_len=30, vocab_size=500, seed=4)
    shape = dict(vocab_size=500, hidden_size=128, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=256,
                 max_sequence_length=1024, recompute=True)
    seed_all(0)
    model32 = build_tiny_gpt(TinyGPTConfig(**shape)).to(device)
    model16 = build_tiny_gpt(TinyGPTConfig(**shape, params_dtype=torch.bfloat16)).to(device=device, dtype=torch.bfloat16)
    model16.load_state_dict(model32.state_dict())
    apply_harts(model16)
    w = torch.randn(sum(len(s) - 1 for s in seqs), generator=torch.Generator().manual_seed(0)).to(device)

    lp_ref, _ = _per_sequence(model32, seqs, device)
    (lp_ref.float() * w).sum().backward()
    g_ref = _grads(model32)

    def run(forest):
        model16.zero_grad(set_to_none=True)
        params = make_tree_params(forest, backend="varlen", save_gathered_kv=save_gathered_kv)
        lp = sequence_logprobs(tree_forward(model16, forest, params=params, chunk_size=128).logp, forest)
        (lp.float() * w).sum().backward()
        return lp.detach().double(), _grads(model16)

    tree, thd = run(build_forest(seqs, device=device).padded(16)), run(build_chain_forest(seqs, device=device).padded(16))
    assert tree[0].shape == thd[0].shape == lp_ref.shape and set(tree[1]) == set(thd[1]) == set(g_ref)
    err = {"logp": tuple(float((x[0] - lp_ref).abs().max()) for x in (tree, thd))}
    for name, ref in g_ref.items():
        err[name] = tuple(float((x[1][name].double() - ref.double()).norm() / ref.double().norm()) for x in (tree, thd))
    return err


def check_varlen_bf16(device: str, save_gathered_kv: bool) -> None:
    """Tree error ≤ 3 × THD error (plus a floor of one bf16 ulp at 1) for every entry of
    :func:`_varlen_bf16_errors`; shared by the CPU test and the GPU lane."""
    for name, (tree, thd) in _varlen_bf16_errors(device, save_gathered_kv).items():
        assert thd < 0.1, (name, thd)  # the THD error itself is bf16-sized, so the bound means something
        assert tree <= 3 * thd + 2**-7, (name, tree, thd)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("save", [False, True], ids=["regather", "save_gathered_kv"])
def test_tree_varlen_bf16_as_close_as_thd(cpu_megatron, save):
    """bf16 model through the varlen gather plan on the CPU kernels (fp32 math inside, bf16
    in and out, as flash): log-probs and every gradient are as close to fp32 per-sequence
    execution as bf16 THD packing through the same kernels is. The GPU lane runs the same check
    on the flash and Triton kernels."""
    check_varlen_bf16("cpu", save)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("recompute", [False, True], ids=["no-recompute", "recompute"])
@pytest.mark.parametrize("seqs", CASES)
def test_tree_equals_per_sequence_fp64(cpu_megatron, seqs, recompute):
    run_exactness(seqs, dtype=torch.float64, recompute=recompute, tol=1e-10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("varlen_mode", ["gather", "levels"])
def test_tree_equals_per_sequence_varlen_backend(cpu_megatron, varlen_mode):
    """The varlen backend inside the model, both plans (ancestor-path key gather; cascade of
    levels merged by log-sum-exp), fwd+bwd, fp64 (CPU kernels with the flash math)."""
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 3, 8, 9], [1, 2, 3, 4, 5, 6], [1, 2], [9, 9, 9]]
    run_exactness(seqs, dtype=torch.float64, recompute=True, tol=1e-10, backend="varlen", varlen_mode=varlen_mode)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum"])
def test_tree_equals_per_sequence_fp32_tied(cpu_megatron, mode):
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 3, 8, 9], [1, 2, 3, 4, 5, 6], [1, 2]]
    run_exactness(seqs, dtype=torch.float32, recompute=False, mode=mode, tie=True, tol=1e-5)


@pytest.mark.timeout(120)
def test_tree_equals_per_sequence_dropless_moe(cpu_megatron):
    """Dropless top-2 MoE (allgather dispatcher): routing is per token, so trees stay exact.

    Megatron always takes the router softmax in fp32 (``moe_utils.topk_routing_with_score_function``),
    and at a fork the summed upstream gradient is rounded to fp32 once instead of per branch, so
    gradients agree to fp32 rounding of the router path (1e-8) while values stay at 1e-10.
    """
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [1, 2, 3, 8, 9], [1, 2, 3, 4, 5, 6], [9, 9]]
    run_exactness(seqs, dtype=torch.float64, recompute=False, tol=1e-10, grad_tol=1e-8, num_moe_experts=4,
                  moe_router_topk=2)


@pytest.mark.timeout(120)
def test_flex_forward_matches_dense_in_megatron(cpu_megatron):
    """FlexAttention (forward only on CPU) through the real model equals the dense backend."""
    from harts.megatron import apply_harts, tree_forward

    seed_all(3)
    model = build_tiny_gpt(TinyGPTConfig(vocab_size=VOCAB, params_dtype=torch.float64)).double()
    core = model.decoder.layers[0].self_attention.core_attention
    base = type(core)
    handle = apply_harts(model)
    assert type(core).__name__ == f"Tree{base.__name__}" and isinstance(core, base)
    apply_harts(model).remove()  # idempotent: a second call swaps and hooks nothing
    assert type(core).__name__ == f"Tree{base.__name__}" and len(model.decoder._forward_pre_hooks) == 1
    seqs = [list(range(1, 40)), list(range(1, 30)) + [50, 51, 52], [1, 2, 3, 9, 9, 9], [5] * 20]
    forest = build_forest(seqs).padded(16)
    with torch.no_grad():
        dense = tree_forward(model, forest, backend="dense")
        flex = tree_forward(model, forest, backend="flex")
    assert_close("flex logp", dense.logp, flex.logp, atol=1e-10, rtol=1e-10)
    from harts.forest import TokenOutOfRangeError

    with pytest.raises(TokenOutOfRangeError, match=f"token id {VOCAB} >= model vocab_size {VOCAB}"):
        tree_forward(model, build_forest([[1, VOCAB]]), backend="dense")
    handle.remove()
    assert type(core) is base and len(model.decoder._forward_pre_hooks) == 0
    assert_close("flex entropy", dense.entropy, flex.entropy, atol=1e-10, rtol=1e-10)


def test_incompatible_configs_raise():
    from harts.megatron import TreeIncompatibleError, check_tree_compatible

    with pytest.raises(TreeIncompatibleError, match="context_parallel_size=2"):
        check_tree_compatible(type("C", (), {"context_parallel_size": 2})())
    with pytest.raises(TreeIncompatibleError, match="mtp_num_layers=1"):
        check_tree_compatible(type("C", (), {"mtp_num_layers": 1})())
    moe = type("C", (), {"num_moe_experts": 4, "moe_expert_capacity_factor": 1.0})()
    with pytest.raises(TreeIncompatibleError, match="moe_expert_capacity_factor=1.0"):
        check_tree_compatible(moe)


@pytest.mark.timeout(120)
def test_mrope_depth_positions(cpu_megatron):
    """mRoPE honours ``position_ids``: tree_forward passes depth on all three sections."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from harts.megatron import apply_harts, tree_forward
    from mcore_distill.testing import transformer_config

    seed_all(5)
    tc = transformer_config(TinyGPTConfig(vocab_size=VOCAB, params_dtype=torch.float64, extra={"mrope_section": [2, 3, 3]}))
    model = GPTModel(config=tc, transformer_layer_spec=get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"),
                     vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="mrope").double()
    apply_harts(model)
    seqs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 7], [9, 2, 3]]
    forest = build_forest(seqs)
    with torch.no_grad():
        out = tree_forward(model, forest, backend="dense")
        lps = []
        for s in seqs:
            t = torch.tensor(s)
            causal = torch.triu(torch.ones(len(s), len(s), dtype=torch.bool), diagonal=1)[None, None]
            logits = model(t[None], torch.arange(len(s)).expand(3, 1, -1), causal)[0]
            lps.append(torch.log_softmax(logits, -1)[:-1].gather(-1, t[1:, None]).squeeze(-1))
    assert_close("mrope logp", torch.cat(lps), sequence_logprobs(out.logp, forest), atol=1e-10, rtol=1e-10)


@pytest.mark.timeout(120)
def test_tree_layer_spec(cpu_megatron):
    """Substitution at build time (layer spec) gives the same model and results as apply_harts."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from harts.megatron import apply_harts, tree_forward, tree_layer_spec
    from mcore_distill.testing import transformer_config

    cfg = TinyGPTConfig(vocab_size=VOCAB, params_dtype=torch.float64)
    spec = tree_layer_spec(get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    seed_all(21)
    m_spec = GPTModel(config=transformer_config(cfg), transformer_layer_spec=spec, vocab_size=VOCAB,
                      max_sequence_length=64, position_embedding_type="rope").double()
    seed_all(21)
    m_swap = build_tiny_gpt(cfg).double()
    core = m_spec.decoder.layers[0].self_attention.core_attention
    assert getattr(type(core), "_harts_tree", False)
    apply_harts(m_spec)  # installs the RoPE hook; the attention classes are already tree-capable
    apply_harts(m_swap)
    f = build_forest(CASES[1].values[0])
    with torch.no_grad():
        a, b = tree_forward(m_spec, f, backend="dense"), tree_forward(m_swap, f, backend="dense")
    assert_close("spec vs swap", b.logp, a.logp, atol=1e-13, rtol=1e-13)
