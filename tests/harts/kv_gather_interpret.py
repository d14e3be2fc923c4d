"""Runs :func:`harts.varlen.gather_kv_triton` and :func:`harts.varlen.sum_kv_copies` (the key
gather of the varlen tree attention and its backward) under Triton's CPU interpreter against the
plain-torch gather and the fp64 sum of the same copies. Started by ``tests/harts/test_attention.py``
in a subprocess with ``TRITON_INTERPRET=1`` (set before Triton is imported); prints one JSON line:
per case, whether the gathers are bitwise equal and, for the sums, the largest ratio of the error
to its bound ``u·|ref| + m·2^-24·Σ|terms|`` (``m`` terms summed in fp32, then one rounding with
unit ``u``: 0 for fp32 output; 2^-7 for bf16, as the interpreter rounds toward zero).
"""

from __future__ import annotations

import json
import sys

import torch

from harts.forest import build_forest
from harts.varlen import (
    build_varlen_plan,
    gather_kv,
    gather_kv_triton,
    sum_kv_copies,
    sum_row_copies_reference,
)


def main(seqs: list[list[int]]) -> dict[str, float | bool]:
    f = build_forest(seqs)
    plan = build_varlen_plan(f.seg_offsets, f.seg_parent, mode="gather")
    out: dict[str, float | bool] = {}
    for heads, kv_heads, dim in ((4, 2, 8), (3, 3, 6), (6, 2, 5)):
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{heads}/{kv_heads}x{dim}/{str(dtype)[6:]}"
            g = torch.Generator().manual_seed(heads + dim)
            rep = heads // kv_heads
            mixed = torch.randn(f.num_nodes, kv_heads, (rep + 2) * dim, generator=g).to(dtype)
            k, v = mixed[:, :, rep * dim:(rep + 1) * dim], mixed[:, :, (rep + 1) * dim:]  # both strided
            got, ref = gather_kv_triton(k, v, plan.kv_index, heads), gather_kv(k, v, plan.kv_index, heads)
            out[f"gather {name}"] = all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
            gk, gv = (torch.randn(plan.kv_index.numel(), heads, dim, generator=g).to(dtype) for _ in "kv")
            dk, dv = sum_kv_copies(gk, gv, plan.copy_ptr, plan.copy_pos, kv_heads)
            m = int(plan.copy_ptr.diff().max()) * rep
            u = 0.0 if dtype == torch.float32 else 2.0**-7
            ratio = 0.0
            for gr, d in ((gk, dk), (gv, dv)):
                r = sum_row_copies_reference(gr.double(), plan.kv_index, f.num_nodes, kv_heads)
                terms = sum_row_copies_reference(gr.double().abs(), plan.kv_index, f.num_nodes, kv_heads)
                bound = u * r.abs() + m * 2.0**-24 * terms + 1e-300
                ratio = max(ratio, float(((d.double() - r).abs() / bound).max()))
            out[f"sum {name}"] = ratio
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
