"""HTTPTeacher against a real HTTP server serving a tiny transformers Qwen3 (same contract as SGLang)."""

from __future__ import annotations

import pytest
import torch

from mcore_distill.testing import assert_close, free_port
from mopd.backends import HTTPTeacher
from mopd.config import RoutingSpec, TeacherPoolConfig
from mopd.errors import (
    ConfigError,
    NonFiniteInputError,
    TeacherBrokenError,
    TeacherServerError,
    TeacherTimeoutError,
)
from mopd.hf_server import HFTeacherServer, ServerFaults
from mopd.routing import score_routed
from mopd.teachers import TeacherPool, TeacherState
from tests.mopd.mopd_helpers import reference_logp, tiny_qwen3, token_batch


@pytest.fixture(scope="module")
def model():
    return tiny_qwen3(7)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("max_new_tokens,max_batch,score_from", [(1, 64, False), (0, 2, True)])
def test_scores_match_local_model(model, temperature, max_new_tokens, max_batch, score_from):
    batch = token_batch(5, 11, seed=3, score_from=score_from)
    with HFTeacherServer(model) as server:
        teacher = HTTPTeacher("t", server.url, temperature=temperature, max_batch=max_batch,
                              max_new_tokens=max_new_tokens, server_scales_temperature=True)
        teacher.load()
        got = teacher.score(batch)
    expect = reference_logp(model, batch, temperature)
    assert_close("logp", expect, got.double(), atol=1e-5, rtol=1e-5)
    assert torch.equal(got != 0, batch.label_mask() & (expect != 0))
    assert teacher.requests == 1 + -(-5 // max_batch)


def test_temperature_reaches_the_server(model):
    batch = token_batch(2, 6, seed=1)
    with HFTeacherServer(model) as server:
        a = HTTPTeacher("t", server.url, temperature=1.0).score(batch)
        b = HTTPTeacher("t", server.url, temperature=0.5, server_scales_temperature=True).score(batch)
    assert (a - b).abs().max() > 1e-3
    with pytest.raises(ConfigError, match="needs a server that scales input-token log-probs"):
        HTTPTeacher("t", "http://unused:1", temperature=0.5)


def test_transient_5xx_is_retried(model):
    with HFTeacherServer(model, faults=ServerFaults(fail_first=2)) as server:
        teacher = HTTPTeacher("t", server.url, max_retries=2, retry_backoff_s=0.01)
        teacher.load()
        assert server.requests == 3


def test_server_down_breaks_teacher_after_bounded_retries():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    teacher = HTTPTeacher("math", url, max_retries=2, retry_backoff_s=0.01, timeout_s=2.0)
    pool = TeacherPool({"math": teacher}, config=TeacherPoolConfig())
    with pytest.raises(TeacherServerError, match=rf"teacher 'math': {url}/health failed after 3 attempts"):
        pool.acquire("math")
    assert teacher.requests == 3 and pool.state("math") is TeacherState.BROKEN and teacher.closed
    with pytest.raises(TeacherBrokenError):
        pool.acquire("math")


def test_slow_server_times_out(model):
    with HFTeacherServer(model, faults=ServerFaults(delay_s=1.0)) as server:
        teacher = HTTPTeacher("t", server.url, timeout_s=0.2, max_retries=1, retry_backoff_s=0.0)
        with pytest.raises(TeacherTimeoutError, match="timed out after 0.2s, 2 attempts"):
            teacher.score(token_batch(1, 4))


def test_bad_request_is_not_retried(model):
    with HFTeacherServer(model) as server:
        teacher = HTTPTeacher("t", server.url, max_retries=3)
        with pytest.raises(TeacherServerError, match="HTTP 400"):
            teacher._request("/generate", {"input_ids": [[1, 2]], "logprob_start_len": 9})
        assert teacher.requests == 1


def test_nan_teacher_logprob_is_a_typed_error_naming_teacher_and_sample(model):
    batch = token_batch(3, 6, seed=2)
    spec = RoutingSpec(routes={"a": {"srv": 1.0}})
    with HFTeacherServer(model, faults=ServerFaults(nan_at=(0, 3))) as server:
        pool = TeacherPool({"srv": HTTPTeacher("srv", server.url)}, config=TeacherPoolConfig())
        with pytest.raises(NonFiniteInputError, match="teacher 'srv' returned non-finite log-prob nan for batch "
                                                      "sample 0 at position 2"):
            score_routed(pool, batch, ["a"] * 3, spec)
        pool.close()


# ---- SGLang 0.5.17 reply contract (mode="sglang-0.5.17" reproduces it; see mopd/hf_server.py) ----

def _batch_with_last_vocab_id(vocab: int):
    """Rows holding id V-1 at a label position (row 0), at the unscored start position whose
    entry is padded with None (row 1) and as the last token (row 2)."""
    from mopd.backends import TokenBatch

    b = token_batch(4, 11, vocab=vocab, seed=3, score_from=True)
    ids, sf = b.input_ids.clone(), b.score_from.clone()
    sf[1] = 2
    ids[0, 5] = ids[1, 2] = ids[2, int(b.lengths[2]) - 1] = vocab - 1
    ids[3, 4] = 0
    return TokenBatch(ids, b.lengths, sf)


@pytest.mark.parametrize("max_new_tokens", [0, 1])
def test_sglang_reply_reports_last_vocab_id_as_zero(model, max_new_tokens):
    V = model.config.vocab_size
    batch = _batch_with_last_vocab_id(V)
    with HFTeacherServer(model, mode="sglang-0.5.17") as server:
        raw = HTTPTeacher("t", server.url)._request("/generate", {
            "input_ids": batch.input_ids[0, : int(batch.lengths[0])].tolist(), "return_logprob": True,
            "logprob_start_len": 0, "sampling_params": {"max_new_tokens": max_new_tokens}})
        entries = raw["meta_info"]["input_token_logprobs"]
        assert entries[5][1] == 0 and entries[0][0] is None  # SGLang's shape: id V-1 reported as 0
        got = HTTPTeacher("t", server.url, vocab_size=V, max_new_tokens=max_new_tokens, max_batch=3).score(batch)
        with pytest.raises(TeacherServerError, match=rf"row 0 position 5: server token id 0 != request id {V - 1} "
                                                     rf"\(misaligned log-probs\).*pass vocab_size={V}"):
            HTTPTeacher("t", server.url).score(batch)
    expect = reference_logp(model, batch, 1.0)
    assert_close("logp", expect, got.double(), atol=1e-5, rtol=1e-5)
    assert got[0, 4] != 0 and got[2, int(batch.lengths[2]) - 2] != 0  # the V-1 labels are scored


@pytest.mark.parametrize("where,reported", [((0, 7), 0), ((3, 7), 1)], ids=["zero-for-other-id", "off-by-one"])
def test_alignment_check_stays_strict_with_vocab_size(model, where, reported):
    batch = _batch_with_last_vocab_id(model.config.vocab_size)
    fault = ServerFaults(wrong_id_at=(*where, reported))
    with HFTeacherServer(model, mode="sglang-0.5.17", faults=fault) as server:
        teacher = HTTPTeacher("t", server.url, vocab_size=model.config.vocab_size)
        with pytest.raises(TeacherServerError, match=rf"row {where[0]} position {where[1]}: server token id "
                                                     rf"{reported} != request id \d+ \(misaligned"):
            teacher.score(batch)


def test_sglang_input_logprobs_ignore_request_temperature(model):
    """SGLang 0.5.17 scales only sampling/output log-probs by the temperature: a client that
    wrongly declares ``server_scales_temperature`` gets T=1 log-probs (hence the default refusal)."""
    batch = token_batch(3, 9, seed=4)
    with HFTeacherServer(model, mode="sglang-0.5.17") as server:
        got = HTTPTeacher("t", server.url, temperature=0.6, server_scales_temperature=True).score(batch)
        with pytest.raises(TeacherServerError, match="HTTP 400"):
            HTTPTeacher("t", server.url, max_retries=0)._request("/generate", {"input_ids": [[1, 480]]})
    assert_close("logp", reference_logp(model, batch, 1.0), got.double(), atol=1e-5, rtol=1e-5)


def test_vocab_size_comes_from_spec_or_hf_config(tmp_path):
    import json

    from mopd.config import TeacherSpec

    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 151936}))
    assert HTTPTeacher.from_spec("t", TeacherSpec(backend="http", url="http://h:1", hf_path=str(tmp_path)),
                                 temperature=1.0).vocab_size == 151936
    assert HTTPTeacher.from_spec("t", TeacherSpec(backend="http", url="http://h:1", hf_path=str(tmp_path),
                                                  vocab_size=64), temperature=1.0).vocab_size == 64
    with pytest.raises(ConfigError, match="teacher.vocab_size must be an int >= 2"):
        TeacherSpec(backend="http", url="http://h:1", vocab_size=1)
