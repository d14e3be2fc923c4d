"""``bench._common.time_interleaved``: every function runs once per round, the round's first
function rotates, and the reported minimum is the minimum of that function's own samples."""

from __future__ import annotations

import time

from bench._common import time_interleaved


def test_rounds_rotate_and_each_function_keeps_its_own_samples():
    calls = []
    naps = {"a": 0.0, "b": 0.004, "c": 0.008}
    fns = {n: (lambda n=n: (calls.append(n), time.sleep(naps[n]))) for n in naps}
    got = time_interleaved(fns, rounds=4, warmup=1)
    assert calls[:3] == ["a", "b", "c"]  # warm-up, once each
    rounds = [calls[3 + 3 * r: 6 + 3 * r] for r in range(4)]
    assert [r[0] for r in rounds] == ["a", "b", "c", "a"]  # round r starts at the r-th function
    assert all(sorted(r) == ["a", "b", "c"] for r in rounds)
    for n, nap in naps.items():
        assert got[n]["n"] == 4 and len(got[n]["samples"]) == 4
        assert got[n]["min"] == min(got[n]["samples"]) >= nap * 1e3
        assert got[n]["p20"] <= got[n]["p50"] <= got[n]["p80"]
        # the host's issue time of a sample is within its wall time (here: the sleep, all on the host)
        assert all(nap * 1e3 <= i <= w for i, w in zip(got[n]["issue_samples"], got[n]["samples"]))
    assert got["c"]["min"] > got["a"]["min"]
