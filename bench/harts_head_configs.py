"""Time configurations of the LM head's two Triton GEMM kernels, each in its own process.

The autotuner (``harts.lm_head_triton._MM_CONFIGS``) times its candidates inside the training
process, so a candidate that could abort the process (a compiler crash, e.g. Triton's experimental
warp specialization on Hopper) is tried here first. For each kernel and configuration (``BEST``,
the autotuner's choice on the H200, then ``EXTRA``; ``--every``: then the rest of the autotuner's
list) a child process builds the benchmark's shapes (one 1024-row forward chunk against the whole
vocabulary; one 2048-column backward block against 16,384 rows), runs the kernel with that
explicit configuration and with ``BEST``, times it (``triton.testing.do_bench``, median ms of the
wrapper call: kernel, output allocation, descriptors) and compares the outputs: ``E`` and the tile
statistics (forward), ``dz`` (backward); ``max_abs_diff`` 0 means bitwise equal.

Run on the GPU: ``python -m bench.harts_head_configs`` (``--only logit_grad``, ``--every``). Writes
``harts_head_configs.json`` into ``bench._common.out_dir()`` and prints the table, fastest first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

from bench._common import machine_header, out_dir, print_table

T, H, V, CHUNK, BLOCK = 16384, 2048, 151936, 1024, 2048

# (BM, BN, BK, num_warps, num_stages, TMA, PERSIST, FLAT, programs per SM, OSTORE, WS): candidates not
# (yet) in the autotuner's list. Non-flattened persistent kernels with two programs per SM (the warp
# scheduler overlaps one program's epilogue with the other's MMA), and Triton's automatic warp
# specialization of the persistent loop.
EXTRA = {
    "logit_tiles": [(128, 128, 64, 4, 3, True, True, False, 2, False, False),
                    (128, 128, 64, 8, 4, True, True, False, 1, False, False),
                    (128, 128, 64, 4, 3, True, True, False, 1, False, True),
                    (128, 128, 64, 8, 3, True, True, False, 1, False, True),
                    (128, 128, 64, 8, 3, True, True, True, 1, False, True)],
    "logit_grad": [(128, 128, 64, 4, 3, True, True, False, 2, False, False),
                   (128, 128, 64, 4, 4, True, True, False, 2, False, False),
                   (128, 256, 64, 8, 3, True, True, False, 1, False, True),
                   (128, 128, 64, 4, 3, True, True, False, 1, False, True),
                   (128, 256, 64, 8, 3, True, True, True, 1, False, True)],
}


# The autotuner's choice on the H200 (2026-12-01 23:03, with the bulk tensor store): the reference every
# candidate is compared with. (The 2026-12-02 03:42 probe used the 17:44 choice, without that store.)
BEST = {"logit_tiles": (128, 128, 64, 8, 4, True, True, True, 1, True, False),
        "logit_grad": (128, 256, 64, 8, 3, True, True, True, 1, True, False)}


def candidates(name: str, every: bool = False) -> list[dict]:
    """``BEST`` first, then ``EXTRA`` (``every``: then the rest of the autotuner's list)."""
    from harts.lm_head_triton import _MM_CONFIGS

    out = []
    rest = [(*c, False) for c in _MM_CONFIGS[name] if (*c, False) != BEST[name]] if every else []
    for c in [BEST[name]] + EXTRA[name] + rest:
        bm, bn, bk, w, st, tma, persist, flat, occ, ostore, ws = c
        out.append({"BM": bm, "BN": bn, "BK": bk, "num_warps": w, "num_stages": st, "TMA": tma, "PERSIST": persist,
                    "FLAT": flat, "occ": occ, "OSTORE": ostore, "WS": ws, "extra": c in EXTRA[name]})
    return out


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16()
    tok = torch.randint(0, V, (T,), device="cuda", generator=g)
    row_ptr = torch.arange(T + 1, device="cuda")
    return h, w, tok, row_ptr


def _explicit(cfg: dict, sms: int) -> dict:
    kw = {k: cfg[k] for k in ("BM", "BN", "BK", "TMA", "PERSIST", "FLAT", "OSTORE", "WS", "num_warps", "num_stages")}
    kw["NP"] = sms * cfg["occ"] if cfg["PERSIST"] else 1
    return kw


def child(name: str, index: int) -> dict:
    import triton

    from harts import lm_head_triton as tri

    cfg = candidates(name, every=True)[index]
    ref_cfg = candidates(name)[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    h, w, tok, row_ptr = _inputs()
    inv = torch.ones(1, device="cuda")
    if name == "logit_tiles":
        x, rp = h[:CHUNK], row_ptr[:CHUNK + 1]
        tgt = torch.empty(CHUNK, device="cuda")

        def run(c):
            e, pm, ps, pq = tri.logit_tiles(x, w, rp, tok, tgt, inv, config=_explicit(c, sms))
            return [e, pm, ps, pq]
        flops = 2.0 * CHUNK * H * V
    else:
        lse = torch.cat([torch.logsumexp(h[i:i + CHUNK].float() @ w.float().T, -1) for i in range(0, T, CHUNK)])
        wb = w[:BLOCK]
        ones, zeros = torch.ones(T, device="cuda"), torch.zeros(T, device="cuda")
        out = torch.empty(T, BLOCK, dtype=torch.bfloat16, device="cuda")

        def run(c):
            tri.logit_grad(h, wb, 0, lse, ones, None, zeros, row_ptr, tok, ones, inv, out, config=_explicit(c, sms))
            return [out]
        flops = 2.0 * T * H * BLOCK
    want = [x.clone() for x in run(ref_cfg)]
    got = run(cfg)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
    ms = triton.testing.do_bench(lambda: run(cfg), warmup=25, rep=200)
    return {**cfg, "kernel": name, "ms": ms, "tflops": flops / ms / 1e9, "max_abs_diff": diff}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["logit_tiles", "logit_grad"])
    ap.add_argument("--every", action="store_true", help="also the rest of the autotuner's configurations")
    ap.add_argument("--child", nargs=2, metavar=("KERNEL", "INDEX"), help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds per configuration")
    args = ap.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], int(args.child[1]))))
        return
    rows = []
    for name in [args.only] if args.only else ["logit_tiles", "logit_grad"]:
        for i, cfg in enumerate(candidates(name, args.every)):
            try:
                p = subprocess.run([sys.executable, "-m", "bench.harts_head_configs", "--child", name, str(i)],
                                   capture_output=True, text=True, timeout=args.timeout)
                res = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
                row = json.loads(res[-1][7:]) if res else {**cfg, "kernel": name, "ms": float("inf"),
                                                           "error": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}
            except subprocess.TimeoutExpired:
                row = {**cfg, "kernel": name, "ms": float("inf"), "error": "timeout"}
            rows.append(row)
            print(json.dumps(row), flush=True)
    (out_dir() / "harts_head_configs.json").write_text(json.dumps({"header": machine_header(), "rows": rows}, indent=1))
    table = [{"kernel": r["kernel"], "tile": f'{r["BM"]}x{r["BN"]}x{r["BK"]} w{r["num_warps"]} s{r["num_stages"]}',
              "flags": "".join(f for f, k in (("T", "TMA"), ("P", "PERSIST"), ("F", "FLAT"), ("O", "OSTORE"),
                                              ("W", "WS")) if r[k]) + f' x{r["occ"]}',
              "new": "new" if r["extra"] else "", "ms": r["ms"], "TFLOP/s": r.get("tflops"),
              "max|diff| / error": r.get("max_abs_diff", r.get("error"))}
             for r in sorted(rows, key=lambda r: (r["kernel"], r["ms"]))]
    print_table(table, ["kernel", "tile", "flags", "new", "ms", "TFLOP/s", "max|diff| / error"])

if __name__ == "__main__":
    main()
