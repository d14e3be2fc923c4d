"""Embedded transformers engine: sampling with logprobs against a plain recomputation,
determinism by seed, greedy, top-k, the residency / update surface, and control-plane
responsiveness (pause / abort / destroy bounded during a large rollout, resume to identical tokens,
updates while paused, an event loop that keeps ticking during big tokenization)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from colocate import EngineConfig, HFModelSpec, NotResidentError, PublishConfig
from colocate.engines import (
    AsyncEngine,
    ControlTimeoutError,
    EngineDestroyedError,
    GenerationAbortedError,
    HFEngine,
    UpdateError,
    WeightReceiver,
    hf_checkpoint_views,
    off_loop,
)
from colocate.publish import Publisher, PublishError
from colocate.residency import BusyError

SPEC = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                   head_dim=8, ffn_hidden_size=48, vocab_size=64, rope_theta=10000.0)


def _recompute_logprobs(engine, prompt, tokens, temperature):
    """Log-probabilities of ``tokens`` after ``prompt`` from one full, unpadded forward."""
    ids = torch.tensor([list(prompt) + list(tokens)])
    logits = engine.logits(ids)[0, len(prompt) - 1: -1]
    lp = torch.log_softmax(logits / (temperature or 1.0), -1)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    e = HFEngine(SPEC, EngineConfig(max_new_tokens=6, temperature=1.0))
    with torch.no_grad():
        for v in hf_checkpoint_views(e.model).values():
            v.normal_(0, 0.3)  # a peaked distribution so sampling is not uniform noise
    return e


def test_protocol_and_capabilities(engine):
    assert isinstance(engine, WeightReceiver)
    assert engine.capabilities() == {"inprocess", "shm", "disk"}


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0], ids=["T1", "T0.7", "greedy"])
def test_batched_sampling_logprobs_match_full_forward(engine, temperature):
    prompts = [[1, 2, 3, 4, 5], [7], [9, 8, 7]]  # ragged: left padding in the batch
    out = engine.generate(prompts, temperature=temperature, seed=5)
    for p, toks, lps in zip(prompts, out.tokens, out.logprobs):
        assert len(toks) == 6
        ref = _recompute_logprobs(engine, p, toks, temperature)
        assert torch.allclose(torch.tensor(lps, dtype=torch.float32), ref, atol=1e-5, rtol=0), (lps, ref)
    if temperature == 0:
        for p, toks in zip(prompts, out.tokens):
            ids = list(p)
            for t in toks:  # greedy equals step-by-step argmax of the full forward
                assert t == int(engine.logits(torch.tensor([ids]))[0, -1].argmax())
                ids.append(t)


def test_seeds_are_deterministic_and_per_sequence(engine):
    a = engine.generate([[1, 2], [3, 4, 5]], seed=11)
    b = engine.generate([[1, 2], [3, 4, 5]], seed=11)
    c = engine.generate([[1, 2], [3, 4, 5]], seed=12)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert a.tokens != c.tokens
    alone = engine.generate([[1, 2]], seed=11)  # sequence 0 does not depend on the others
    assert alone.tokens[0] == a.tokens[0]


def test_top_k_restricts_support(engine):
    prompt = [4, 5, 6]
    out = engine.generate([prompt] * 4, temperature=1.0, top_k=1, seed=0, max_new_tokens=3)
    greedy = engine.generate([prompt], temperature=0.0, max_new_tokens=3)
    assert all(t == greedy.tokens[0] for t in out.tokens)
    assert all(abs(lp) < 1e-6 for lps in out.logprobs for lp in lps)  # only one token left: log 1
    with pytest.raises(ValueError, match="prompt needs >= 1 token"):
        engine.generate([[1], []])
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.generate([[1]], temperature=-1.0)


def test_residency_cycle_and_republish():
    torch.manual_seed(1)
    e = HFEngine(SPEC)
    pub = Publisher(e, PublishConfig(bucket_bytes=32 << 10))
    w = {n: v.detach().clone() for n, v in hf_checkpoint_views(e.model).items()}
    pub.publish(w, version=1)
    ids = torch.tensor([[1, 2, 3, 4]])
    before = e.logits(ids)
    freed = e.release_memory(["kv_cache", "weights", "cuda_graph"])
    assert freed["weights"] == 2 * sum(t.numel() * 4 for t in w.values())  # live weights + staging shadow
    assert e.release_memory() == {}
    with pytest.raises(NotResidentError):
        e.generate([[1]])
    with pytest.raises(PublishError) as ei:
        pub.publish(w, version=2)  # cannot stage into released weights
    assert isinstance(ei.value.cause, NotResidentError) and ei.value.phase == "begin"
    e.resume_memory(["weights"])
    with pytest.raises(NotResidentError, match=r"needs \['kv_cache', 'cuda_graph'\]"):
        e.logits(ids)
    e.resume_memory()
    with pytest.raises(NotResidentError, match="not re-published"):
        e.logits(ids)
    pub.publish(w, version=3)
    assert torch.equal(e.logits(ids), before)
    # release is refused while the engine is busy
    with e.residency.busy(), pytest.raises(BusyError):
        e.release_memory(["kv_cache"])


def test_rollback_and_update_bracket_errors():
    e = HFEngine(SPEC)
    with pytest.raises(UpdateError, match="load without begin_update"):
        e.load_tensors([])
    with pytest.raises(UpdateError, match="end_update\\(3\\) without a matching"):
        e.end_update(3)
    w0 = e.checksums()
    e.begin_update(1)
    e.load_tensors([("model.norm.weight", torch.full((32,), 2.0))])
    e.end_update(1)
    assert e.weight_version() == 1 and e.checksums() != w0
    e.rollback()
    assert e.checksums() == w0 and e.weight_version() is None


def test_rollback_and_late_abort_report_the_version_served():
    """After a rollback (a failed read-back) or an abort of a version already committed, the
    engine serves the previous weights and says so: ``weight_version()`` is that version."""
    e = HFEngine(SPEC)
    norm = "model.norm.weight"
    for v in (1, 2):
        e.begin_update(v)
        e.load_tensors([(norm, torch.full((32,), float(v)))])
        e.end_update(v)
    e.rollback()
    assert e.weight_version() == 1 and torch.equal(e.read(norm), torch.full((32,), 1.0))
    with pytest.raises(UpdateError, match="nothing committed"):
        e.rollback()  # once: the shadow now holds the version rolled back from
    e.begin_update(3)
    e.load_tensors([(norm, torch.full((32,), 3.0))])
    e.end_update(3)
    e.abort_update(3)  # the publisher gave up on 3 after it was committed
    assert e.weight_version() == 1 and torch.equal(e.read(norm), torch.full((32,), 1.0))

    class LateVersion(HFEngine):  # commits, then reads back another version for 5: the publisher rolls back
        def weight_version(self):
            v = super().weight_version()
            return 99 if v == 5 else v

    e = LateVersion(SPEC)
    pub = Publisher(e, PublishConfig(bucket_bytes=16 << 10))
    w4 = {n: torch.randn(s, generator=torch.Generator().manual_seed(4)) for n, (s, _) in e.param_specs().items()}
    pub.publish(w4, version=4)
    with pytest.raises(PublishError) as ei:
        pub.publish({n: t + 1 for n, t in w4.items()}, version=5)
    assert ei.value.phase == "verify" and e.weight_version() == 4
    assert all(torch.equal(e.read(n), t) for n, t in w4.items())


# ----- control plane ------------------------------------------------------------------------
BOUND = 5.0  # seconds any control request may take; one decode step of 16 rows here is a few ms
NEW, ROWS, CHUNK = 60, 32, 16
PROMPTS = [[1 + i % 50, 2, 3 + i % 7] for i in range(ROWS)]


def _engine(seed: int = 0) -> HFEngine:
    torch.manual_seed(seed)
    e = HFEngine(SPEC, EngineConfig(max_new_tokens=NEW, temperature=1.0))
    with torch.no_grad():
        for v in hf_checkpoint_views(e.model).values():
            v.normal_(0, 0.3)
    return e


@pytest.fixture(scope="module")
def ref():
    """An uninterrupted large rollout: the tokens every paused-and-resumed run must reproduce."""
    e = _engine()
    out = e.generate(PROMPTS, seed=3, chunk_rows=CHUNK)
    part = e.generate(PROMPTS[CHUNK:2 * CHUNK], seed=3 + CHUNK)  # rows do not depend on chunking
    assert part.tokens == out.tokens[CHUNK:2 * CHUNK] and part.logprobs == out.logprobs[CHUNK:2 * CHUNK]
    return out


class _Rollout:
    """``generate`` in a thread; ``result`` or ``error`` when done."""

    def __init__(self, engine: HFEngine):
        self.engine, self.result, self.error = engine, None, None
        start = engine.tokens_generated
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while engine.tokens_generated < start + 5:  # wait until it is really generating
            assert time.monotonic() < deadline and self.thread.is_alive(), "rollout did not start"
            time.sleep(0.002)

    def _run(self):
        try:
            self.result = self.engine.generate(PROMPTS, seed=3, chunk_rows=CHUNK)
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc


@pytest.mark.timeout(120)
def test_pause_is_bounded_parks_and_resumes_to_identical_tokens(ref):
    e = _engine()
    r = _Rollout(e)
    t0 = time.monotonic()
    e.resume()  # not paused: returns at once, does not wait for the running generation's lock
    assert time.monotonic() - t0 < 1.0 and r.thread.is_alive()
    t0 = time.monotonic()
    e.pause(timeout=BOUND)
    assert time.monotonic() - t0 < BOUND and e.paused
    n = e.tokens_generated
    time.sleep(0.3)
    assert e.tokens_generated == n and r.thread.is_alive()  # parked, not finished
    # a weight update proceeds while paused (same values, so the tokens stay comparable)
    same = {k: v.clone() for k, v in hf_checkpoint_views(e.model).items()}
    upd = threading.Thread(target=lambda: (e.begin_update(7), e.load_tensors(same.items()), e.end_update(7)))
    upd.start()
    upd.join(BOUND)
    assert not upd.is_alive() and e.weight_version() == 7
    e.resume()
    r.thread.join(60)
    assert r.error is None and not r.thread.is_alive()
    assert r.result.tokens == ref.tokens and r.result.logprobs == ref.logprobs


@pytest.mark.timeout(120)
def test_abort_is_bounded_returns_partial_and_engine_stays_usable(ref):
    e = _engine()
    r = _Rollout(e)
    t0 = time.monotonic()
    e.abort(timeout=BOUND)
    r.thread.join(BOUND)
    assert time.monotonic() - t0 < BOUND and not r.thread.is_alive()
    assert isinstance(r.error, GenerationAbortedError), r.error
    got = r.error.partial.tokens
    assert 0 < sum(map(len, got)) < ROWS * NEW
    assert all(g == full[:len(g)] for g, full in zip(got, ref.tokens, strict=True))  # prefixes of the full run
    again = e.generate(PROMPTS[:2], seed=3, max_new_tokens=4)  # the abort does not stick
    assert again.tokens == [t[:4] for t in ref.tokens[:2]]


@pytest.mark.timeout(120)
def test_abort_while_paused_and_destroy_during_rollout():
    e = _engine()
    r = _Rollout(e)
    e.pause(timeout=BOUND)
    e.abort(timeout=BOUND)  # parked generations are woken and stop
    r.thread.join(BOUND)
    assert isinstance(r.error, GenerationAbortedError) and e.paused
    e.resume()
    r = _Rollout(e)
    t0 = time.monotonic()
    e.destroy(timeout=BOUND)
    r.thread.join(BOUND)
    assert time.monotonic() - t0 < BOUND and isinstance(r.error, GenerationAbortedError)
    assert "destroyed" in str(r.error)
    assert sum(p.numel() for p in e.model.parameters()) == 0  # weights freed
    with pytest.raises(EngineDestroyedError):
        e.generate([[1]])
    with pytest.raises(EngineDestroyedError):
        e.begin_update(1)
    e.destroy(timeout=BOUND)  # idempotent


def test_control_timeout_is_typed_and_names_the_request():
    e = _engine()
    held, release = threading.Event(), threading.Event()

    def long_update():  # an uninterruptible section longer than the bound (lock held throughout)
        with e._lock:
            held.set()
            release.wait(10)

    th = threading.Thread(target=long_update)
    th.start()
    held.wait(5)
    with pytest.raises(ControlTimeoutError, match=r"pause: not done within timeout=0.1s") as ei:
        e.pause(timeout=0.1)
    assert ei.value.op == "pause" and isinstance(ei.value, TimeoutError)
    with pytest.raises(ControlTimeoutError, match=r"^destroy: not done within timeout=0.1s"):
        e.destroy(timeout=0.1)
    with pytest.raises(EngineDestroyedError):  # a destroy that timed out still refuses new work
        e.generate([[1]])
    release.set()
    th.join(5)
    e.destroy(timeout=BOUND)  # the retry frees the weights
    assert sum(p.numel() for p in e.model.parameters()) == 0
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        _engine().generate([[1]], chunk_rows=0)


class _SlowTokenizer:
    """A pure-Python tokenizer (bytes mod 64, with a busy loop per character) for CPU-heavy encodes."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for ch in text:
            h = ord(ch)
            for _ in range(40):
                h = (h * 31 + 7) % 1000003
            out.append(h % 64)
        return out


async def _max_heartbeat_gap(work) -> tuple[float, float, object]:
    """Run ``work()`` (a coroutine factory) next to a 5 ms heartbeat; (max gap, duration, result)."""
    ticks: list[float] = []
    stop = asyncio.Event()

    async def beat():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.005)

    hb = asyncio.create_task(beat())
    await asyncio.sleep(0.02)
    t0 = time.perf_counter()
    res = await work()
    dur = time.perf_counter() - t0
    await asyncio.sleep(0.02)
    stop.set()
    await hb
    inside = [t for t in ticks if t >= t0 - 0.01]
    gaps = [b - a for a, b in zip(inside, inside[1:], strict=False)]
    return max(gaps), dur, res


@pytest.mark.timeout(120)
def test_event_loop_keeps_ticking_during_big_tokenization_and_rollout():
    texts = [f"booking {i}: change flight to seat {i % 37}" * 4 for i in range(800)]
    tok = _SlowTokenizer()

    async def main():
        ae = AsyncEngine(_engine(), tokenizer=tok)

        async def inline():  # the failure mode: tokenizing on the loop blocks it for the whole batch
            return [tok.encode(t) for t in texts]

        gap_inline, dur_inline, ids_inline = await _max_heartbeat_gap(inline)
        gap_off, dur_off, ids_off = await _max_heartbeat_gap(lambda: ae.encode(texts))
        assert ids_off == ids_inline
        assert gap_inline > 0.5 * dur_inline  # the check can fail: inline work stalls the loop
        assert dur_off > 0.2 and gap_off < min(0.25, dur_off / 3), (gap_off, dur_off)
        blob = await ae.serialize({"ids": ids_off})
        assert len(blob) > 0
        # a rollout through the front: the loop ticks, and a pause from the loop completes in bound
        gen = asyncio.create_task(ae.generate(PROMPTS, seed=3, chunk_rows=CHUNK))
        while ae.engine.tokens_generated < 5:
            await asyncio.sleep(0.002)
        t0 = time.perf_counter()
        await ae.pause(timeout=BOUND)
        assert time.perf_counter() - t0 < BOUND and not gen.done()
        await ae.resume()
        out = await gen
        assert len(out.tokens) == ROWS and all(len(t) == NEW for t in out.tokens)
        await ae.destroy(timeout=BOUND)
        with pytest.raises(EngineDestroyedError):
            await ae.generate([[1]])
        assert await off_loop(sum, [1, 2, 3]) == 6

    asyncio.run(main())
