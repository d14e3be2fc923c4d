"""``assert_close`` that says how far off a tensor is: max-abs, RMS ratio, first mismatches."""

from __future__ import annotations

import torch

__all__ = ["assert_close"]


def assert_close(name: str, ref: torch.Tensor, out: torch.Tensor, *, atol: float, rtol: float = 0.0) -> None:
    """Raise ``AssertionError`` unless ``|out - ref| <= atol + rtol * |ref|`` elementwise.

    Shapes must match exactly; NaN/inf must sit at the same positions. The message names the
    tensor and reports max-abs error, RMS(out - ref) / RMS(ref), and the first 5 mismatches.
    """
    if ref.shape != out.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    r = ref.detach().to(torch.float64).cpu()
    o = out.detach().to(torch.float64).cpu()
    finite_r, finite_o = torch.isfinite(r), torch.isfinite(o)
    if not torch.equal(finite_r, finite_o) or not torch.equal(r[~finite_r], o[~finite_o]):
        raise AssertionError(f"{name}: non-finite values differ ({(~finite_o).sum()} vs {(~finite_r).sum()} in ref)")
    diff = (o - r).abs().where(finite_r, torch.zeros_like(r))
    bad = diff > atol + rtol * r.abs().where(finite_r, torch.zeros_like(r))
    if bad.any():
        idx = bad.nonzero()[:5].tolist()
        rms = (diff.pow(2).mean().sqrt() / r.where(finite_r, torch.zeros_like(r)).pow(2).mean().sqrt().clamp_min(1e-300)).item()
        firsts = ", ".join(f"{tuple(i)}: {o[tuple(i)].item():.6g} vs {r[tuple(i)].item():.6g}" for i in idx)
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{bad.numel()} elements off (atol={atol}, rtol={rtol}); "
            f"max-abs {diff.max().item():.3e}, rms ratio {rms:.3e}; first: {firsts}"
        )
