"""Runs FLA's Triton ``causal_conv1d`` kernels under Triton's CPU interpreter to check
:func:`harts.gdn.tree_causal_conv1d_fla` (trie context passed as the per-segment initial state)
against the torch tree convolution, with FLA's own chunk-index preparation disabled (the plan
supplies the indices). Started by ``tests/harts/test_gdn.py`` in a subprocess with
``TRITON_INTERPRET=1`` (set before Triton is imported); prints one JSON line of max errors.

The interpreter cannot benchmark, so FLA's autotuned kernels get a constant timing (Triton 3.6's
``Autotuner.do_bench``): every config "ties" and the first one runs.
"""

from __future__ import annotations

import json
import sys

import triton.runtime.autotuner as autotuner

autotuner.Autotuner.do_bench = property(lambda self: lambda fn, quantiles: (fn(), [1.0, 1.0, 1.0])[1])

import torch  # noqa: E402

from harts.forest import build_forest  # noqa: E402
from harts.gdn import build_gdn_plan, tree_causal_conv1d, tree_causal_conv1d_fla  # noqa: E402


def _no_index_rebuild(*args, **kwargs):
    raise AssertionError("FLA rebuilt the chunk indices (on CUDA: a host computation and a synchronizing copy); "
                         "the plan's conv_chunk_indices should have been used")


def main(cases: dict[str, list[list[int]]]) -> dict[str, float]:
    import fla.modules.causal_conv1d.ops as conv_ops

    conv_ops.prepare_chunk_indices = _no_index_rebuild  # the tree conv hands FLA the plan's indices
    err: dict[str, float] = {}
    for name, seqs in cases.items():
        f = build_forest(seqs).padded(8)
        plan = build_gdn_plan(f, chunk_size=16, conv_width=4)
        for width in (4, 2, 1):
            g = torch.Generator().manual_seed(width)
            # x is a column slice of a wider tensor, as the conv channels are of Megatron's in_proj output
            x0, w0, b0 = torch.randn(f.num_nodes, 10, generator=g), torch.randn(6, width, generator=g), torch.randn(6)
            outs = []
            for fla in (True, False):
                xw, w, b = (z.clone().requires_grad_(True) for z in (x0, w0, b0))
                x = xw[:, 2:8]
                y = (tree_causal_conv1d_fla(x, w, b, plan=plan, activation="silu") if fla
                     else tree_causal_conv1d(x, w, b, anc=plan.anc, activation="silu"))
                y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
                outs.append((y.detach(), xw.grad, w.grad, b.grad))
            err[f"{name}/W{width}"] = max(float((a - r).abs().max()) for a, r in zip(*outs, strict=True))
    return err


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
