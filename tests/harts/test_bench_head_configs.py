"""``bench.harts_head_configs`` (a GPU probe) stays consistent with the kernels it probes: its
reference is one of the autotuner's candidates, every configuration names each launch flag of
the two GEMM kernels, and explicit launch parameters follow the SM count."""

from __future__ import annotations

import inspect

from bench import harts_head_configs as probe
from harts import lm_head_triton as tri


def test_probe_reference_is_an_autotuner_candidate_and_flags_match_the_kernels():
    for name in ("logit_tiles", "logit_grad"):
        assert probe.BEST[name][:-1] in tri._MM_CONFIGS[name] and probe.BEST[name][-1] is False
        cands = probe.candidates(name)
        assert cands[0]["extra"] is False and len(cands) == 1 + len(probe.EXTRA[name])
        every = probe.candidates(name, every=True)
        assert len(every) == len(tri._MM_CONFIGS[name]) + len(probe.EXTRA[name])
        params = set(inspect.signature(tri._KERNELS[name].fn).parameters)
        for c in every:
            kw = probe._explicit(c, sms=132)
            assert set(kw) - {"num_warps", "num_stages"} <= params, set(kw) - params
            assert kw["NP"] == (132 * c["occ"] if c["PERSIST"] else 1)
