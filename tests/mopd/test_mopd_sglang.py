"""GPU lane, real SGLang 0.5.17: HTTPTeacher log-probs from an SGLang HTTP server equal the
Megatron teacher's for the same weights (bf16 server vs fp32 Megatron on bf16-rounded weights).

Run on the H200 with the carried SGLang batches (see ../shared/tools/sglang-gpu/README.md):
``bash .sgl/scripts/go.sh -m pytest -m sglang tests/mopd/test_mopd_sglang.py -q -x -s``
(first server start ~90-110 s on a fresh box; the whole file ≤ ~4 min).

The server is started by ``SGLangEngine.launch_server`` from a ``SGLangServerConfig`` (role
``teacher``): a guarded colocated worker in its own process group, killed by the fixture's
``shutdown`` (which the test then checks left no process of the group); start-up, health and
every request have timeouts, so a broken server fails these tests and never hangs or kills pytest. The CPU twin of the reply contract checked here is
``tests/mopd/test_http_teacher.py`` (``HFTeacherServer(mode="sglang-0.5.17")``).
"""

from __future__ import annotations

import os

import pytest
import torch

from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, free_port, init_megatron, seed_all
from mopd.backends import HTTPTeacher, TokenBatch
from mopd.config import RoutingSpec, TeacherPoolConfig
from mopd.errors import TeacherServerError
from mopd.hf_weights import QwenShape, hf_qwen3_config, megatron_to_hf_qwen3
from mopd.routing import score_routed
from mopd.teachers import TeacherPool
from tests.mopd.mopd_helpers import token_batch

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]

V = 1024
CFG = TinyGPTConfig(vocab_size=V, hidden_size=256, num_layers=2, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=512, max_sequence_length=256)
SHAPE = QwenShape(num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=64)
START_TIMEOUT_S = 300.0

# bf16 tolerance on |Δ log p| per scored token: SGLang computes activations and logits in bf16
# (relative rounding 2^-8 ≈ 0.4% per op, logits here of magnitude ~5-10 after the ×10 head),
# Megatron in fp32 on the same bf16-rounded weights.
MEAN_TOL, MAX_TOL = 0.02, 0.15


@pytest.fixture(scope="module")
def megatron_state():
    """NCCL world of one, Megatron parallel state, and the teacher weights rounded to bf16."""
    from megatron.core import parallel_state

    torch.cuda.set_device(0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    torch.distributed.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    init_megatron(tp=1, pp=1)
    seed_all(21)
    model = build_tiny_gpt(CFG)
    with torch.no_grad():
        model.output_layer.weight.mul_(10.0)
        for p in model.parameters():  # identical weights on both sides: round to bf16 once
            p.copy_(p.to(torch.bfloat16).float())
    yield model
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def sglang_url(megatron_state, tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    d = tmp_path_factory.mktemp("qwen3_tiny")
    hf = Qwen3ForCausalLM(hf_qwen3_config(vocab_size=V, hidden_size=CFG.hidden_size,
                                          ffn_hidden_size=CFG.ffn_hidden_size, shape=SHAPE,
                                          max_position_embeddings=CFG.max_sequence_length))
    sd = {k: v for k, v in megatron_state.state_dict().items() if isinstance(v, torch.Tensor)}
    hf.load_state_dict(megatron_to_hf_qwen3(sd, SHAPE), strict=True)
    hf.to(torch.bfloat16).save_pretrained(d)
    from colocate import HFModelSpec, SGLangEngine
    from colocate.config import SGLangServerConfig
    from tests._procs import group_gone

    # the teacher's server: a colocated worker of this process with the teacher role's environment
    log_dir = os.environ.get("MCD_TEST_ARTIFACTS") or str(d)
    os.makedirs(log_dir, exist_ok=True)
    cfg = SGLangServerConfig(model_path=str(d), role="teacher", cuda_graph=False, memory_saver=False,
                             start_timeout_s=START_TIMEOUT_S, request_timeout_s=120.0,
                             log_path=os.path.join(log_dir, "mopd_teacher_server.log"))
    spec = HFModelSpec(arch="qwen3", num_layers=SHAPE.num_layers, hidden_size=CFG.hidden_size,
                       num_attention_heads=SHAPE.num_attention_heads, num_query_groups=SHAPE.num_query_groups,
                       head_dim=SHAPE.head_dim, ffn_hidden_size=CFG.ffn_hidden_size, vocab_size=V)
    eng = SGLangEngine.launch_server(cfg, spec=spec)
    group = eng.client.worker.pid
    try:
        probe = HTTPTeacher("probe", eng.client.base_url, timeout_s=5.0, max_retries=0)
        probe.load()
        yield eng.client.base_url
    finally:
        eng.shutdown()
    assert group_gone(group, timeout=30.0), "a process of the teacher's SGLang server outlived its owner's shutdown"


def _batch() -> TokenBatch:
    """8 rows of ≤ 200 random ids holding the last vocabulary id V-1 at a label position (row 1),
    at the unscored start position (row 2) and as a row's last token (row 4)."""
    b = token_batch(8, 200, vocab=V, seed=5, score_from=True)
    ids, sf = b.input_ids.clone(), b.score_from.clone()
    sf[2] = 2
    ids[1, 17] = ids[2, 2] = ids[4, int(b.lengths[4]) - 1] = V - 1
    return TokenBatch(ids, b.lengths, sf)


def _megatron_logp(megatron_state, tmp_path, batch: TokenBatch, temperature: float) -> torch.Tensor:
    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint

    save_teacher_checkpoint(megatron_state, str(tmp_path / "meg"))
    seed_all(22)
    host = MegatronTeacherHost(build_tiny_gpt(CFG).cuda(), micro_batch_size=4)
    pool = TeacherPool({"meg": MegatronTeacher("meg", host, str(tmp_path / "meg"), temperature=temperature)},
                       config=TeacherPoolConfig(wait_timeout_s=300.0))
    spec = RoutingSpec(routes={"m": {"meg": 1.0}})
    cuda = TokenBatch(batch.input_ids.cuda(), batch.lengths.cuda(), batch.score_from.cuda())
    targets, _ = score_routed(pool, cuda, ["m"] * batch.input_ids.shape[0], spec)
    pool.close()
    return targets.logp_sum.cpu()


def _sglang_logp(teacher: HTTPTeacher, batch: TokenBatch) -> torch.Tensor:
    pool = TeacherPool({"sgl": teacher}, config=TeacherPoolConfig(wait_timeout_s=300.0))
    spec = RoutingSpec(routes={"s": {"sgl": 1.0}})
    targets, _ = score_routed(pool, batch, ["s"] * batch.input_ids.shape[0], spec)
    pool.close()
    return targets.logp_sum


def _report(tag: str, meg: torch.Tensor, sgl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    diff = (meg - sgl).abs()[mask]
    print(f"{tag}: max |Δlogp| {diff.max():.4f}, mean {diff.mean():.5f}, tokens {int(mask.sum())}, "
          f"mean logp {meg[mask].mean():.3f}")
    return diff


@pytest.mark.timeout(420)
@pytest.mark.parametrize("max_new_tokens", [1, 0])
def test_sglang_teacher_equals_megatron_teacher(megatron_state, sglang_url, tmp_path, max_new_tokens):
    batch = _batch()
    mask = batch.label_mask()
    meg = _megatron_logp(megatron_state, tmp_path, batch, 1.0)
    sgl = _sglang_logp(HTTPTeacher("sgl", sglang_url, timeout_s=30.0, max_retries=1, max_batch=8,
                                   max_new_tokens=max_new_tokens, vocab_size=V), batch)
    diff = _report(f"T=1.0 max_new_tokens={max_new_tokens}", meg, sgl, mask)
    assert meg[mask].abs().mean() > 0.5  # non-trivial distributions
    assert diff.mean() < MEAN_TOL and diff.max() < MAX_TOL
    # the labels that are the last vocabulary id (reported by SGLang as id 0) are scored too
    for b, t in [(1, 16), (4, int(batch.lengths[4]) - 2)]:
        assert sgl[b, t] != 0 and abs(float(meg[b, t] - sgl[b, t])) < MAX_TOL


@pytest.mark.timeout(420)
def test_sglang_reports_last_vocab_id_as_zero_and_client_needs_vocab_size(sglang_url):
    """The reply shape found in SGLang 0.5.17's source, observed on the real server."""
    batch = _batch()
    n = int(batch.lengths[1])
    raw = HTTPTeacher("raw", sglang_url, timeout_s=30.0, max_retries=1)._request("/generate", {
        "input_ids": batch.input_ids[1, :n].tolist(), "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 1, "temperature": 1.0}})
    entries = raw["meta_info"]["input_token_logprobs"]
    assert len(entries) == n and entries[0][0] is None
    assert [e[1] for e in entries][17] == 0  # request id V-1
    assert all(e[1] == int(t) for i, (e, t) in enumerate(zip(entries, batch.input_ids[1, :n])) if i != 17)
    with pytest.raises(TeacherServerError, match=rf"server token id 0 != request id {V - 1}.*vocab_size={V}"):
        HTTPTeacher("sgl", sglang_url, timeout_s=30.0, max_retries=1).score(batch)


@pytest.mark.timeout(420)
def test_sglang_input_logprobs_ignore_request_temperature(megatron_state, sglang_url, tmp_path):
    """SGLang 0.5.17 returns unscaled input-token log-probs whatever the request temperature, so
    HTTPTeacher refuses rollout_temperature ≠ 1 unless the server is declared to scale them. A
    teacher wrongly declared so (here on purpose) gets the T=1 log-probs, not the T=0.7 ones."""
    batch = _batch()
    mask = batch.label_mask()
    meg1 = _megatron_logp(megatron_state, tmp_path, batch, 1.0)
    meg07 = _megatron_logp(megatron_state, tmp_path, batch, 0.7)
    sgl = _sglang_logp(HTTPTeacher("sgl", sglang_url, temperature=0.7, timeout_s=30.0, max_retries=1, max_batch=8,
                                   vocab_size=V, server_scales_temperature=True), batch)
    diff1 = _report("request T=0.7 vs Megatron T=1.0", meg1, sgl, mask)
    diff07 = _report("request T=0.7 vs Megatron T=0.7", meg07, sgl, mask)
    assert diff1.mean() < MEAN_TOL and diff1.max() < MAX_TOL
    assert diff07.mean() > 10 * MEAN_TOL
