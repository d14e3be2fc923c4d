"""HTTPTeacher against a real HTTP server serving a tiny transformers Qwen3 (same contract as SGLang),
including a fault matrix: every fault is a typed error within the request budget."""

from __future__ import annotations

import gc
import math
import time
import weakref

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
    with pytest.raises(TeacherServerError, match=rf"teacher 'math': {url}/health failed after 3 attempt\(s\) "
                                                 r"in [\d.]+s: ConnectionRefusedError"):
        pool.acquire("math")
    assert teacher.requests == 3 and pool.state("math") is TeacherState.BROKEN and teacher.closed
    with pytest.raises(TeacherBrokenError):
        pool.acquire("math")


def test_slow_server_times_out(model):
    with HFTeacherServer(model, faults=ServerFaults(delay_s=1.0)) as server:
        teacher = HTTPTeacher("t", server.url, timeout_s=0.2, max_retries=1, retry_backoff_s=0.0)
        with pytest.raises(TeacherTimeoutError, match=r"timed out: budget timeout_s=0.2s spent after 1 attempt"):
            teacher.score(token_batch(1, 4))


def test_bad_request_is_not_retried(model):
    with HFTeacherServer(model) as server:
        teacher = HTTPTeacher("t", server.url, max_retries=3)
        with pytest.raises(TeacherServerError, match="HTTP 400"):
            teacher._request("/generate", {"input_ids": [[1, 2]], "logprob_start_len": 9})
        assert teacher.requests == 1


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


# ---- fault matrix: a real server misbehaving in every way a client can see ----------------------

DEADLINE = 2.0  # HTTPTeacher.timeout_s where the fault makes the client wait for it (stall, trickle, slow)
ROOMY = 20.0  # timeout_s where it should not matter: every attempt fits even on a loaded CI host
SLACK = 3.0  # scheduling noise on a loaded host; a client without a deadline overshoots by minutes
RETRIED, ONCE = 3, 1  # attempts: max_retries=2 -> 3 for transient faults, 1 for unusable replies

# (id, faults or None for "nothing listens", error, message pattern, attempts, budget)
MATRIX = [
    ("down", None, TeacherServerError, r"failed after 3 attempt\(s\).*ConnectionRefusedError", RETRIED, ROOMY),
    ("stall", {"reply": "stall"}, TeacherTimeoutError, r"budget timeout_s=2.0s spent after 1 attempt", ONCE,
     DEADLINE),
    ("trickle", {"reply": "trickle", "trickle_s": 0.4}, TeacherTimeoutError, r"budget timeout_s=2.0s spent", ONCE,
     DEADLINE),
    ("slow", {"delay_s": 3.0 + SLACK}, TeacherTimeoutError, r"budget timeout_s=2.0s spent", ONCE, DEADLINE),
    ("reset", {"reply": "reset"}, TeacherServerError, r"failed after 3 attempt.*(ConnectionReset|RemoteDisconnected)",
     RETRIED, ROOMY),
    ("5xx", {"status": 503}, TeacherServerError, r"failed after 3 attempt.*HTTP 503", RETRIED, ROOMY),
    ("4xx", {"status": 422}, TeacherServerError, r"answered HTTP 422", ONCE, ROOMY),
    ("truncated", {"reply": "truncated"}, TeacherServerError, r"failed after 3 attempt.*IncompleteRead", RETRIED,
     ROOMY),
    ("bad-status-line", {"reply": "bad_status"}, TeacherServerError, r"failed after 3 attempt.*BadStatusLine",
     RETRIED, ROOMY),
    ("bad-json", {"reply": "bad_json"}, TeacherServerError, r"not UTF-8 JSON", ONCE, ROOMY),
    ("bad-utf8", {"reply": "bad_utf8"}, TeacherServerError, r"not UTF-8 JSON \('utf-8' codec", ONCE, ROOMY),
    ("bad-entry", {"reply": "bad_entry"}, TeacherServerError, r"row 0 position \d+: entry 'oops' is not \[logprob",
     ONCE, ROOMY),
    ("short-entries", {"reply": "short_entries"}, TeacherServerError, r"row 0 got 6 input log-probs, expected 7",
     ONCE, ROOMY),
    ("extra-results", {"reply": "extra_results"}, TeacherServerError, r"expected 3 results, got list of length 4",
     ONCE, ROOMY),
    ("nan", {"nan_at": (1, 3)}, TeacherServerError, r"row 1 position 3: log-prob nan is not a number in \[-inf, 0\]",
     ONCE, ROOMY),
    ("+inf", {"logprob_at": (1, 3, math.inf)}, TeacherServerError, r"row 1 position 3: log-prob inf is not", ONCE,
     ROOMY),
    ("positive", {"logprob_at": (2, 4, 0.25)}, TeacherServerError, r"row 2 position 4: log-prob 0.25 is not", ONCE,
     ROOMY),
]


def _matrix_batch():
    from mopd.backends import TokenBatch

    b = token_batch(3, 7, seed=5)
    return TokenBatch(b.input_ids, torch.full((3,), 7), None)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,faults,error,match,attempts,budget", MATRIX, ids=[m[0] for m in MATRIX])
def test_fault_is_a_typed_error_within_budget_and_breaks_the_teacher(model, name, faults, error, match, attempts,
                                                                     budget):
    """Each fault: the documented error type, raised within ``timeout_s`` (retries included), the
    attempts the docs promise (transient faults retried, unusable replies not), the pool BROKEN."""
    server = None if faults is None else HFTeacherServer(model, faults=ServerFaults(**faults)).start()
    url = f"http://127.0.0.1:{free_port()}" if server is None else server.url
    teacher = HTTPTeacher("t", url, timeout_s=budget, max_retries=2, retry_backoff_s=0.05)
    pool = TeacherPool({"t": teacher}, config=TeacherPoolConfig(wait_timeout_s=5.0))
    try:
        if server is None:  # the health check in acquire() meets the dead server
            t0 = time.monotonic()
            with pytest.raises(error, match=match):
                pool.acquire("t")
        else:
            lease = pool.acquire("t")  # /health answers; the fault is in /generate
            before = teacher.requests
            t0 = time.monotonic()
            with pytest.raises(error, match=match):
                with lease:
                    lease.score(_matrix_batch())
        elapsed = time.monotonic() - t0
        assert elapsed < budget + SLACK, f"{name}: {elapsed:.2f}s for a {budget}s budget"
        if budget == DEADLINE:
            assert elapsed >= budget - 0.05  # it waited for the whole budget, not for a per-read timeout
        assert teacher.requests - (0 if server is None else before) == attempts
        assert pool.state("t") is TeacherState.BROKEN and teacher.closed
        with pytest.raises(TeacherBrokenError, match=error.__name__):
            pool.acquire("t")
    finally:
        pool.close()
        if server is not None:
            server.stop()


def test_minus_inf_logprob_is_returned_and_the_routed_scorer_refuses_it(model):
    """−inf (probability 0) is a valid log-prob: the client returns it, the sampled-token target
    cannot use it, so score_routed raises NonFiniteInputError naming teacher, sample and position;
    the teacher did nothing wrong and stays RESIDENT and usable."""
    batch = _matrix_batch()
    spec = RoutingSpec(routes={"a": {"srv": 1.0}})
    with HFTeacherServer(model, faults=ServerFaults(logprob_at=(1, 3, -math.inf))) as server:
        teacher = HTTPTeacher("srv", server.url, timeout_s=ROOMY)
        got = teacher.score(batch)
        assert got[1, 2] == -math.inf and torch.isfinite(got[0]).all()
        pool = TeacherPool({"srv": teacher}, config=TeacherPoolConfig())
        with pytest.raises(NonFiniteInputError, match="teacher 'srv' returned non-finite log-prob -inf for batch "
                                                      "sample 1 at position 2"):
            score_routed(pool, batch, ["a"] * 3, spec)
        assert pool.state("srv") is TeacherState.RESIDENT
        server.faults.logprob_at = None
        targets, _ = score_routed(pool, batch, ["a"] * 3, spec)
        assert torch.isfinite(targets.logp_sum).all()
        pool.close()


def test_tiny_positive_logprob_is_rounding_and_reads_as_zero(model):
    with HFTeacherServer(model, faults=ServerFaults(logprob_at=(0, 2, 3e-6))) as server:
        got = HTTPTeacher("t", server.url).score(_matrix_batch())
    assert got[0, 1].item() == 0.0


def test_retried_5xx_keeps_no_reference_to_the_scores(model):
    """A failed attempt's exception must not outlive the retry: its traceback would hold the
    scoring frame and its output tensor, and release() would refuse the drained lease."""
    gc.disable()  # the reference cycle must not depend on when the cyclic collector runs
    try:
        with HFTeacherServer(model, faults=ServerFaults(fail_first=1, fail_path="/generate")) as server:
            pool = TeacherPool({"t": HTTPTeacher("t", server.url, retry_backoff_s=0.01)},
                               config=TeacherPoolConfig(wait_timeout_s=2.0))
            with pool.acquire("t") as lease:
                logp = lease.score(token_batch(2, 6)).take()
                ref = weakref.ref(logp)
                del logp
                assert ref() is None, "the scores are still referenced after the consumer dropped them"
            assert server.requests == 2  # one 503, one retry
            with pool.acquire("t") as lease:  # the lease was released: no timeout here
                lease.score(token_batch(2, 6)).take()
            pool.close()
    finally:
        gc.enable()


def test_closed_http_teacher_refuses_to_score():
    from mopd.errors import TeacherStateError

    teacher = HTTPTeacher("t", "http://127.0.0.1:1")
    teacher.close()
    with pytest.raises(TeacherStateError, match="teacher 't' .* is closed"):
        teacher.score(token_batch(1, 4))


@pytest.mark.parametrize("kwargs,match", [({"url": "ftp://h:1"}, "url must be http"), ({"url": "http://h:x"}, "url"),
                                          ({"url": None}, "url"), ({"timeout_s": 0.0}, "timeout_s"),
                                          ({"timeout_s": math.nan}, "timeout_s"),
                                          ({"retry_backoff_s": -1.0}, "retry_backoff_s"),
                                          ({"max_retries": -1}, "max_retries"), ({"max_batch": 0}, "max_batch")])
def test_http_teacher_arguments_are_checked(kwargs, match):
    args = {"url": "http://h:1", **kwargs}
    with pytest.raises(ConfigError, match=match):
        HTTPTeacher("t", args.pop("url"), **args)


@pytest.mark.timeout(240)
def test_teacher_server_launched_as_a_colocated_role_and_closed_with_its_pool(model, tmp_path):
    """The teacher's server started the way a GPU job starts ``sglang.launch_server``
    (``colocate.sglang_clients.HTTPClient.launch`` from a ``SGLangServerConfig``: a guarded worker
    with the teacher role's environment), here ``mopd.hf_server`` in its SGLang 0.5.17 reply mode:
    the pool scores through it (equal to the local model, the last vocabulary id reported as 0
    and accepted with ``vocab_size``); closing the pool kills the server's process group."""
    import os
    from pathlib import Path

    from colocate.config import SGLangServerConfig
    from colocate.sglang_clients import HTTPClient
    from colocate.sglang_engine import sglang_server_launch_args
    from colocate.workers import LocalScheduler
    from tests._procs import group_gone

    model.save_pretrained(tmp_path / "teacher")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    sched = LocalScheduler(owner_env=env)
    cfg = SGLangServerConfig(model_path=str(tmp_path / "teacher"), role="teacher", cuda_graph=False,
                             memory_saver=False, start_timeout_s=180, log_path=str(tmp_path / "teacher.log"))
    args = sglang_server_launch_args(cfg)
    client = HTTPClient.launch(**args, scheduler=sched, ipc="cpu", server_module="mopd.hf_server",
                               mode="sglang-0.5.17")
    V = model.config.vocab_size
    batch = token_batch(4, 12, seed=9, score_from=True)
    batch.input_ids[1, 3] = V - 1  # a label that SGLang reports as id 0
    pool = TeacherPool({"t": HTTPTeacher("t", client.base_url, vocab_size=V, server=client, timeout_s=60)},
                       config=TeacherPoolConfig(wait_timeout_s=120.0))
    group = client.worker.pid
    try:
        assert client.tp_size == 1 and not client.has_bracket
        targets, _ = score_routed(pool, batch, ["r"] * 4, RoutingSpec(routes={"r": {"t": 1.0}}))
        assert_close("logp", reference_logp(model, batch), targets.logp_sum.double(), atol=1e-5, rtol=1e-5)
        assert "ignoring SGLang server flags" in (tmp_path / "teacher.log").read_text()
    finally:
        pool.close()
    assert client.worker is None and group_gone(group, timeout=20), "the teacher's server outlived its pool"
