"""GPU lane, real SGLang: HTTPTeacher log-probs from an SGLang server equal the Megatron
teacher's for the same weights (bf16 server vs fp32 Megatron, bf16 tolerance).

Run on the H200 with the carried SGLang batches (see ../shared/tools/sglang-gpu/README.md):
``bash .sgl/scripts/go.sh -m pytest -m sglang tests/mopd/test_mopd_sglang.py -q -x``
(first server start ~90-110 s on a fresh box; the whole file ≤ ~4 min).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, free_port, init_megatron, seed_all
from mopd.backends import HTTPTeacher, TokenBatch
from mopd.config import RoutingSpec, TeacherPoolConfig
from mopd.errors import TeacherServerError, TeacherTimeoutError
from mopd.hf_weights import QwenShape, hf_qwen3_config, megatron_to_hf_qwen3
from mopd.routing import score_routed
from mopd.teachers import TeacherPool
from tests.mopd.mopd_helpers import token_batch

pytestmark = [pytest.mark.sglang, pytest.mark.gpu]

CFG = TinyGPTConfig(vocab_size=1024, hidden_size=256, num_layers=2, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=512, max_sequence_length=256)
SHAPE = QwenShape(num_layers=2, num_attention_heads=4, num_query_groups=2, head_dim=64)


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
    hf = Qwen3ForCausalLM(hf_qwen3_config(vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size,
                                          ffn_hidden_size=CFG.ffn_hidden_size, shape=SHAPE,
                                          max_position_embeddings=CFG.max_sequence_length))
    sd = {k: v for k, v in megatron_state.state_dict().items() if isinstance(v, torch.Tensor)}
    hf.load_state_dict(megatron_to_hf_qwen3(sd, SHAPE), strict=True)
    hf.to(torch.bfloat16).save_pretrained(d)
    port = free_port()
    log = open(d / "server.log", "w")  # noqa: SIM115 - closed below
    # asks for temperature-scaled input log-probs; builds that ignore it fail the T=0.7 test
    env = dict(os.environ, HF_HUB_OFFLINE="1", SGLANG_TEMP_SCALED_LOGPROBS="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(d), "--host", "127.0.0.1", "--port",
         str(port), "--skip-tokenizer-init", "--attention-backend", "triton", "--sampling-backend", "pytorch",
         "--grammar-backend", "none", "--mem-fraction-static", "0.3", "--max-total-tokens", "65536", "--dtype",
         "bfloat16", "--disable-cuda-graph"], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    probe = HTTPTeacher("probe", url, timeout_s=5.0, max_retries=0)
    deadline = time.monotonic() + 400
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"sglang exited with {proc.returncode}:\n{(d / 'server.log').read_text()[-4000:]}")
            try:
                probe.load()
                break
            except (TeacherServerError, TeacherTimeoutError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"sglang not healthy after 400 s:\n{(d / 'server.log').read_text()[-4000:]}") from None
                time.sleep(2.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()


def _both(megatron_state, url, tmp_path, temperature: float) -> tuple[torch.Tensor, torch.Tensor, TokenBatch]:
    from mopd.megatron import MegatronTeacher, MegatronTeacherHost, save_teacher_checkpoint

    save_teacher_checkpoint(megatron_state, str(tmp_path / "meg"))
    seed_all(22)
    host = MegatronTeacherHost(build_tiny_gpt(CFG).cuda(), micro_batch_size=4)
    backends = {"meg": MegatronTeacher("meg", host, str(tmp_path / "meg"), temperature=temperature),
                "sgl": HTTPTeacher("sgl", url, temperature=temperature, timeout_s=60.0, max_batch=8,
                                   server_scales_temperature=temperature != 1.0)}
    spec = RoutingSpec(routes={"m": {"meg": 1.0}, "s": {"sgl": 1.0}})
    batch = token_batch(8, 200, vocab=CFG.vocab_size, seed=5, score_from=True)
    pool = TeacherPool(backends, config=TeacherPoolConfig(wait_timeout_s=300.0))
    cuda_batch = TokenBatch(batch.input_ids.cuda(), batch.lengths.cuda(), batch.score_from.cuda())
    meg, _ = score_routed(pool, cuda_batch, ["m"] * 8, spec)
    sgl, _ = score_routed(pool, cuda_batch, ["s"] * 8, spec)
    pool.close()
    return meg.logp_sum.cpu(), sgl.logp_sum.cpu(), batch


@pytest.mark.timeout(900)
def test_sglang_teacher_equals_megatron_teacher(megatron_state, sglang_url, tmp_path):
    meg, sgl, batch = _both(megatron_state, sglang_url, tmp_path, temperature=1.0)
    mask = batch.label_mask()
    diff = (meg - sgl).abs()[mask]
    print(f"T=1.0: max |Δlogp| {diff.max():.4f}, mean {diff.mean():.5f}, tokens {int(mask.sum())}, "
          f"mean logp {meg[mask].mean():.3f}")
    assert meg[mask].abs().mean() > 0.5  # non-trivial distributions
    assert diff.mean() < 0.02 and diff.max() < 0.15


@pytest.mark.timeout(900)
def test_sglang_scores_at_rollout_temperature(megatron_state, sglang_url, tmp_path):
    """With ``SGLANG_TEMP_SCALED_LOGPROBS=1`` set for the server, its input-token log-probs must
    follow the request temperature. A failure here means this SGLang build returns unscaled
    log-probs: HTTP teachers then only support rollout_temperature = 1."""
    meg, sgl, batch = _both(megatron_state, sglang_url, tmp_path, temperature=0.7)
    mask = batch.label_mask()
    diff = (meg - sgl).abs()[mask]
    print(f"T=0.7: max |Δlogp| {diff.max():.4f}, mean {diff.mean():.5f}")
    assert diff.mean() < 0.02 and diff.max() < 0.15
