"""Plain-torch references for the Gated DeltaNet tree path (fp64-capable, no Triton).

FLA's own ``naive_*`` functions cast every input to fp32, so they cannot serve as fp64 oracles;
these functions compute in ``promote(input dtype, fp32)`` (fp64 stays fp64) and are tested
against FLA's naive functions in fp32 (``tests/harts/test_gdn.py``).

Gated delta rule, per head, state ``S ∈ R^{K×V}``, decay ``α_t = exp(g_t)``::

    S_t = α_t S_{t-1} + k_t u_tᵀ,   u_t = β_t (v_t − α_t S_{t-1}ᵀ k_t)
    o_t = scale · S_tᵀ q_t

(equivalently ``S_t = α_t (I − β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ``). Argument order is
``(q, k, v, g, beta)`` like FLA's ``chunk_gated_delta_rule``; FLA's
``naive_recurrent_gated_delta_rule`` takes ``(q, k, v, beta, g)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["recurrent_gated_delta_rule_reference", "chunk_gated_delta_rule_reference",
           "causal_conv1d_reference", "l2norm_reference"]


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _expand_heads(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped value attention: repeat q/k heads ``[..., H, K]`` to ``HV`` heads."""
    h = q.shape[-2]
    if hv % h:
        raise ValueError(f"value heads HV={hv} must be a multiple of query/key heads H={h}")
    if hv != h:
        q, k = q.repeat_interleave(hv // h, dim=-2), k.repeat_interleave(hv // h, dim=-2)
    return q, k


def recurrent_gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                         beta: torch.Tensor, *, scale: float | None = None,
                                         initial_state: torch.Tensor | None = None,
                                         output_final_state: bool = False
                                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence. ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``,
    ``initial_state [B, HV, K, V]`` → ``o [B, T, HV, V]`` (compute dtype), final state or None."""
    dt = _compute_dtype(q)
    q, k = _expand_heads(q, k, v.shape[2])
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    b, t, hv, kd = k.shape
    scale = kd ** -0.5 if scale is None else scale
    s = q.new_zeros(b, hv, kd, v.shape[-1]) if initial_state is None else initial_state.to(dt)
    outs = []
    for i in range(t):
        s = s * g[:, i].exp()[..., None, None]
        u = beta[:, i, :, None] * (v[:, i] - torch.einsum("bhk,bhkv->bhv", k[:, i], s))
        s = s + k[:, i, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, i] * scale, s))
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return o, (s if output_final_state else None)


def chunk_gated_delta_rule_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, *, chunk_size: int = 64, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (WY) form, same shapes as :func:`recurrent_gated_delta_rule_reference`.

    Within a chunk with start state ``S_0`` and local cumulative log-decay ``G_i = Σ_{j≤i} g_j``
    (``γ_i = e^{G_i}``), the new values ``U = [u_1..u_c]`` solve the unit lower-triangular system
    ``(I + A) U = β ⊙ (V − Γ K S_0)`` with ``A_ij = β_i e^{G_i−G_j} k_iᵀk_j`` (j < i); then
    ``o_i = scale (γ_i S_0ᵀq_i + Σ_{j≤i} e^{G_i−G_j}(q_iᵀk_j) u_j)`` and
    ``S_c = γ_c S_0 + Σ_j e^{G_c−G_j} k_j u_jᵀ``. Chunks start at offsets ``0, C, 2C, ...``; a
    partial last chunk is zero-padded to ``C`` (as kernels mask a tile), so a row's arithmetic
    does not depend on how many tokens follow it in its chunk.
    """
    dt = _compute_dtype(q)
    q, k = _expand_heads(q, k, v.shape[2])
    # heads first: [B, HV, T, .]
    q, k, v = (x.to(dt).transpose(1, 2) for x in (q, k, v))
    g, beta = (x.to(dt).transpose(1, 2) for x in (g, beta))
    b, hv, t, kd = k.shape
    scale = kd ** -0.5 if scale is None else scale
    s = q.new_zeros(b, hv, kd, v.shape[-1]) if initial_state is None else initial_state.to(dt)
    pad = -t % chunk_size  # zero tokens (k = v = g = β = 0) leave outputs and state unchanged
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    outs = []
    for c0 in range(0, t + pad, chunk_size):
        sl = slice(c0, c0 + chunk_size)
        # fresh contiguous chunks: identical layouts (hence BLAS summation order) for any T
        qc, kc, vc, bc = (x[:, :, sl].contiguous() for x in (q * scale, k, v, beta))
        gc = g[:, :, sl].cumsum(-1)
        n = gc.shape[-1]
        lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # e^{G_i-G_j}, j<=i
        strict = decay.masked_fill(torch.eye(n, dtype=torch.bool, device=q.device), 0.0)
        a = bc[..., :, None] * strict * (kc @ kc.transpose(-1, -2))
        eye = torch.eye(n, dtype=dt, device=q.device)
        rhs = bc[..., None] * (vc - gc.exp()[..., None] * (kc @ s))
        u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
        outs.append(gc.exp()[..., None] * (qc @ s) + (decay * (qc @ kc.transpose(-1, -2))) @ u)
        w = (gc[..., -1:] - gc).exp()[..., None] * kc  # e^{G_c - G_j} k_j
        s = gc[..., -1].exp()[..., None, None] * s + w.transpose(-1, -2) @ u
    o = torch.cat(outs, 2)[:, :, :t].transpose(1, 2) if outs else v.new_zeros(v.transpose(1, 2).shape)
    return o, (s if output_final_state else None)


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                            activation: str | None = "silu") -> torch.Tensor:
    """Sequential depthwise causal conv of one or more sequences: ``x [B, L, D]``, ``weight [D, W]``.

    ``y_t = act(b + Σ_{m<W} weight[:, m] · x_{t−(W−1)+m})`` with zeros before the sequence start,
    i.e. ``F.conv1d`` with left padding ``W − 1`` (Megatron's ``nn.Conv1d`` with ``padding = W − 1``
    truncated to the first ``L`` outputs).
    """
    d, w = weight.shape
    y = F.conv1d(x.transpose(1, 2), weight[:, None, :], bias, padding=w - 1, groups=d)[..., :x.shape[1]]
    y = y.transpose(1, 2)
    return _activate(y, activation)


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")


def l2norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(Σ x² + eps)`` over the last dim (FLA's ``l2norm`` formula)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)
