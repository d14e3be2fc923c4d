"""The SGLang HTTP adapter against a real HTTP server on CPU that implements SGLang 0.5.17's
contract for the routes the adapter uses (JSON bodies, base64 ``ForkingPickler`` tensor payloads
carrying shared-memory handles, in-place loads, idle-only release, errors for resuming an
unreleased tag, optional 0.5.21 bracket) over a real ``transformers`` model; and (GPU lane,
``sglang``) against the real ``sglang.launch_server``."""

from __future__ import annotations

import os
import time

import pytest
import torch

from colocate import HFModelSpec, NotResidentError, PublishConfig, SGLangEngine
from colocate.engines import build_hf_model, hf_checkpoint_views
from colocate.errors import ReceiverDied, ReceiverTimeout, UpdateError
from colocate.publish import PoisonedVersionError, Publisher, PublishError
from colocate.sglang_clients import server_args_to_cli
from colocate.sglang_engine import write_hf_checkpoint

from ._contract_server import SPEC, ContractServer, sha, weights

PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 2, 7]


def _shared_views(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Copies of ``w`` as views of one shared-memory storage (what an in-place publish hands over)."""
    flat = torch.empty(sum(t.numel() for t in w.values())).share_memory_()
    out, off = {}, 0
    for n, t in w.items():
        out[n] = flat[off: off + t.numel()].view(t.shape).copy_(t)
        off += t.numel()
    return out


def _reference_logprobs(w: dict[str, torch.Tensor]) -> torch.Tensor:
    ref = build_hf_model(SPEC)
    views = hf_checkpoint_views(ref)
    with torch.no_grad():
        for n, t in w.items():
            views[n].copy_(t)
        lp = torch.log_softmax(ref(input_ids=torch.tensor([PROMPT])).logits[0, :-1].double(), -1)
    return lp.gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bracket", [False, True], ids=["0.5.17-no-bracket", "0.5.21-bracket"])
def test_http_adapter_publish_verify_residency_and_errors(bracket, tmp_path):
    server = ContractServer(SPEC, bracket=bracket)
    try:
        eng = SGLangEngine.connect(server.url, spec=SPEC, dtype=torch.float32, ipc="cpu", timeout_s=30)
        assert eng.has_bracket is bracket and eng.client.tp_size == 1 and eng.client.health()
        assert eng.tag_bytes() == {"weights": round(0.004 * 2**30), "kv_cache": round(0.047 * 2**30),
                                   "cuda_graph": round(0.002 * 2**30)}
        pub = Publisher(eng, PublishConfig(bucket_bytes=16 << 10), share_min_bytes=None)
        assert pub.transport == "shm"
        w1 = weights(1)
        rep = pub.publish(w1, version=1)
        assert rep.num_buckets > 2 and rep.verify == "version-only"
        assert eng.weight_version() == 1 and server.version == "1"  # stamped on the server, read back
        assert eng.last_checksum is None and eng.checksum() == server.checksum() == sha(w1)  # bit-exact
        # the flush rides on the last load (with the 0.5.21 bracket it follows end_weight_update)
        assert (server.log.count("flush(in update)"), server.log.count("/flush_cache")) == ((0, 1) if bracket else (1, 0))
        got = torch.tensor(eng.prompt_logprobs(PROMPT), dtype=torch.float64)
        assert (got - _reference_logprobs(w1)).abs().max().item() <= 1e-5
        n_updates = server.log.count("/update_weights_from_tensor")
        assert n_updates == rep.num_buckets

        # in place: the tensors are views of one shared-memory storage, handed over unpacked
        w2 = weights(2)
        inplace = _shared_views(w2)
        direct = Publisher(eng, PublishConfig(bucket_bytes=16 << 10), share_min_bytes=1)
        direct.last_good = 1
        rep = direct.publish(inplace, version=2)
        assert rep.num_shared == 1 and rep.num_buckets == 0
        assert server.checksum() == sha(w2) and eng.weight_version() == 2
        assert server.log.count("/update_weights_from_tensor") == n_updates + 1

        # residency: release refused while generating, idempotent here, weights re-published after resume
        server.busy = True
        with pytest.raises(UpdateError, match="only when idle"):
            eng.release_memory(["kv_cache"])
        server.busy = False
        assert eng.residency.is_resident("kv_cache")  # a failed release leaves the tag resident
        eng.release_memory()
        assert server.released == set(server.TAGS) and eng.release_memory() == {}
        with pytest.raises(NotResidentError):
            eng.generate([PROMPT], max_new_tokens=2)
        with pytest.raises(PublishError) as ei:
            pub.publish(w1, version=3)
        assert isinstance(ei.value.cause, NotResidentError) and ei.value.phase == "begin"
        eng.resume_memory(["weights"])
        assert server.checksum() != sha(w2)  # contents lost with the release
        direct.last_good = 3
        direct.publish(inplace, version=4)
        eng.resume_memory()
        assert not server.released and eng.resume_memory() == {}
        assert server.checksum() == sha(w2)
        out = eng.generate([PROMPT, PROMPT[:4]], max_new_tokens=3)
        assert [len(o["output_ids"]) for o in out] == [3, 3]

        # a failing load: typed error, version poisoned, no version valid until a restore
        server.fail_next_update = True
        with pytest.raises(PublishError) as ei:
            pub.publish(w1, version=5)
        assert isinstance(ei.value.cause, UpdateError) and "injected failure" in str(ei.value.cause)
        assert 5 in pub.poisoned and eng.weight_version() is None and not server.in_bracket
        write_hf_checkpoint(tmp_path / "ckpt", w1, spec=SPEC, dtype=torch.float32)
        with pytest.raises(UpdateError, match="no checkpoint"):
            eng.restore_from_disk(str(tmp_path / "missing"), version=6)
        eng.restore_from_disk(str(tmp_path / "ckpt"), version=6)
        assert eng.weight_version() == 6 and server.checksum() == sha(w1)

        # verification fails after the commit (the version read back is not the one stamped):
        # typed error, the version poisoned and never reported, the server stamped "poisoned"
        server.version_suffix = "-stale"
        with pytest.raises(PublishError) as ei:
            pub.publish(w1, version=7)
        assert ei.value.phase == "verify" and "weight_version None after publishing 7" in str(ei.value.cause)
        assert 7 in pub.poisoned and eng.weight_version() is None and server.version == "poisoned"
        with pytest.raises(PoisonedVersionError):
            pub.publish(w1, version=7)
        server.version_suffix = ""
        pub.publish(w2, version=8)
        assert eng.weight_version() == 8 and server.checksum() == sha(w2)

        server.delay_s = 0.5
        eng.client.timeout_s = 0.1
        with pytest.raises(ReceiverTimeout):
            eng.weight_version()
        server.delay_s, eng.client.timeout_s = 0.0, 30
    finally:
        server.close()
    with pytest.raises(ReceiverDied):
        eng.weight_version()


@pytest.mark.timeout(60)
def test_one_deadline_covers_a_trickling_answer():
    """A server that answers one byte every 0.3 s keeps each socket read short: the client's
    deadline bounds the whole request, so the call fails in time with ``ReceiverTimeout``."""
    server = ContractServer(SPEC, bracket=False)
    try:
        eng = SGLangEngine.connect(server.url, spec=SPEC, dtype=torch.float32, ipc="cpu", timeout_s=30)
        server.trickle_s, eng.client.timeout_s = 0.3, 1.0  # /model_info's ~30-byte answer would take ~9 s
        t0 = time.monotonic()
        with pytest.raises(ReceiverTimeout):
            eng.weight_version()
        assert time.monotonic() - t0 < 4.0
        server.trickle_s, eng.client.timeout_s = 0.0, 30
        assert eng.weight_version() is None and server.version == "default"
    finally:
        server.close()


def test_tag_bytes_of_names_a_missing_memory_usage():
    from colocate.errors import ConfigError
    from colocate.sglang_clients import tag_bytes_of

    info = {"internal_states": [{"memory_usage": {"weight": 1.5, "kvcache": 0.25, "graph": {"decode": 0.125, "prefill": 0.0}}}]}
    assert tag_bytes_of(info) == {"weights": 3 << 29, "kv_cache": 1 << 28, "cuda_graph": 1 << 27}
    with pytest.raises(ConfigError, match=r"no internal_states\[0\].memory_usage .*KeyError: 'kvcache'"):
        tag_bytes_of({"internal_states": [{"memory_usage": {"weight": 1.0}}]})
    with pytest.raises(ConfigError, match="IndexError"):
        tag_bytes_of({"internal_states": []})


def test_server_args_to_cli():
    assert server_args_to_cli({"model_path": "/m", "tp_size": 2, "enable_memory_saver": True,
                               "disable_cuda_graph": False, "cuda_graph_bs_decode": [1, 2, 4], "chunked": None}) == \
        ["--model-path", "/m", "--tp-size", "2", "--enable-memory-saver", "--cuda-graph-bs-decode", "1", "2", "4"]


# ------------------------------------------------------------------------ GPU lane, real server
@pytest.mark.gpu
@pytest.mark.sglang
@pytest.mark.timeout(400)
def test_real_sglang_http_server(tmp_path):
    """Publish into a real ``sglang.launch_server`` (its own process group): checksum equal to
    the server's own disk load of the same weights, prompt log-probs vs an fp32 HF reference
    (bf16: max ≤ 0.05, mean ≤ 0.01 nats), weight version read back, residency cycle."""
    from colocate.sglang_engine import sglang_engine_args

    spec = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=256, num_attention_heads=4, num_query_groups=2,
                       head_dim=64, ffn_hidden_size=512, vocab_size=1024, rope_theta=10000.0)
    torch.manual_seed(0)
    init = {n: v.detach().to(torch.bfloat16).clone() for n, v in hf_checkpoint_views(build_hf_model(spec)).items()}
    torch.manual_seed(1)
    new = {n: v.detach().to(torch.bfloat16).clone() for n, v in hf_checkpoint_views(build_hf_model(spec)).items()}
    for d, w in (("init", init), ("new", new)):
        write_hf_checkpoint(tmp_path / d, w, spec=spec)
    args = sglang_engine_args(str(tmp_path / "init"), cuda_graph=True)
    args.pop("log_level")
    env = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1", "HF_HUB_OFFLINE": "1", "PYTORCH_CUDA_ALLOC_CONF": None}
    log_dir = os.environ.get("MCD_TEST_ARTIFACTS") or str(tmp_path)  # the lane keeps the server log there
    os.makedirs(log_dir, exist_ok=True)
    eng = SGLangEngine.launch_server(spec=spec, log_path=os.path.join(log_dir, "sglang_http_server.log"), env=env,
                                  start_timeout_s=300, **args)
    try:
        import sglang.srt.entrypoints.engine as sgl_engine_mod

        assert eng.has_bracket is hasattr(sgl_engine_mod.Engine, "begin_weight_update")  # same release
        c0 = eng.checksum()
        pub = Publisher(eng, PublishConfig(bucket_bytes=1 << 20))
        rep = pub.publish({n: t.cuda() for n, t in new.items()}, version=1)
        assert rep.num_buckets >= 2 and eng.weight_version() == 1
        c1 = eng.checksum()
        assert c1 != c0
        eng.restore_from_disk(str(tmp_path / "new"), version=1)
        eng.client.flush_cache()
        assert eng.checksum() == c1

        ref = build_hf_model(spec, dtype=torch.float32, device="cuda")
        views = hf_checkpoint_views(ref)
        with torch.no_grad():
            for n, t in new.items():
                views[n].copy_(t.float())
            lp = torch.log_softmax(ref(input_ids=torch.tensor([PROMPT], device="cuda")).logits[0, :-1].double(), -1)
        ref_lp = lp.gather(-1, torch.tensor(PROMPT[1:], device="cuda")[:, None])[:, 0].cpu()
        d = (torch.tensor(eng.prompt_logprobs(PROMPT), dtype=torch.float64) - ref_lp).abs()
        print("http server log-prob |diff| max/mean", d.max().item(), d.mean().item())
        assert d.max().item() <= 0.05 and d.mean().item() <= 0.01

        g1 = [o["output_ids"] for o in eng.generate([PROMPT], max_new_tokens=8)]
        freed = eng.release_memory()
        assert freed["kv_cache"] > 0 and freed["weights"] > 0, freed
        eng.resume_memory(["weights"])
        pub.publish({n: t.cuda() for n, t in new.items()}, version=2)
        eng.resume_memory()
        assert eng.checksum() == c1 and eng.weight_version() == 2
        assert [o["output_ids"] for o in eng.generate([PROMPT], max_new_tokens=8)] == g1
    finally:
        eng.shutdown()


@pytest.mark.timeout(120)
def test_flattened_bucket_hand_over(tmp_path):
    """``flattened=True``: each buffer (packed bucket, or the storage shared in place) crosses as
    SGLang's ``flattened_bucket`` payload, one handle for all its tensors, through an unpickler
    that admits SGLang's allow-listed modules only; the server's weights are bit-exact."""
    server = ContractServer(SPEC, bracket=False)
    try:
        eng = SGLangEngine(SGLangEngine.connect(server.url, spec=SPEC, dtype=torch.float32, ipc="cpu").client,
                           spec=SPEC, dtype=torch.float32, flattened=True)
        pub = Publisher(eng, PublishConfig(bucket_bytes=16 << 10), share_min_bytes=None)
        w1 = weights(1)
        rep = pub.publish(w1, version=1)
        assert rep.num_buckets > 2 and server.log.count("flattened") == rep.num_buckets
        assert eng.checksum() == sha(w1) and eng.weight_version() == 1
        w2 = weights(2)
        inplace = _shared_views(w2)
        direct = Publisher(eng, PublishConfig(), share_min_bytes=1)
        direct.last_good = 1
        n0 = server.log.count("flattened")
        rep = direct.publish(inplace, version=2)
        assert rep.num_shared == 1 and rep.num_buckets == 0 and server.log.count("flattened") == n0 + 1
        assert eng.checksum() == sha(w2) and eng.weight_version() == 2
        got = torch.tensor(eng.prompt_logprobs(PROMPT), dtype=torch.float64)
        assert (got - _reference_logprobs(w2)).abs().max().item() <= 1e-5
    finally:
        server.close()
