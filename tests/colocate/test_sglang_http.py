"""The SGLang HTTP adapter against a real HTTP server on CPU that implements SGLang 0.5.17's
contract for the routes the adapter uses (JSON bodies, base64 ``ForkingPickler`` tensor payloads
carrying shared-memory handles, in-place loads, idle-only release, errors for resuming an
unreleased tag, optional 0.5.21 bracket) over a real ``transformers`` model; and (GPU lane,
``sglang``) against the real ``sglang.launch_server``."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from colocate import HFModelSpec, NotResidentError, PublishConfig
from colocate.engines import UpdateError, build_hf_model, hf_checkpoint_views
from colocate.publish import Publisher, PublishError
from colocate.sglang_engine import write_hf_checkpoint
from colocate.sglang_http import SGLangHTTPEngine, server_args_to_cli
from colocate.transports import ReceiverDied, ReceiverTimeout

SPEC = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                   head_dim=8, ffn_hidden_size=48, vocab_size=64, rope_theta=10000.0)
PROMPT = [1, 5, 9, 13, 17, 21, 25, 29, 2, 7]


class ContractServer:
    """SGLang's HTTP contract (the routes the adapter uses) over a CPU ``transformers`` model."""

    TAGS = ("kv_cache", "weights", "cuda_graph")

    def __init__(self, spec: HFModelSpec, *, bracket: bool):
        torch.manual_seed(0)
        self.model = build_hf_model(spec)
        self.views = hf_checkpoint_views(self.model)
        self.bracket, self.in_bracket = bracket, False
        self.released: set[str] = set()
        self.version = "default"
        self.busy = False
        self.fail_next_update = False
        self.delay_s = 0.0
        self.log: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _reply(self, status: int, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except BrokenPipeError:  # the client gave up (the timeout case)
                    pass

            def do_GET(self):
                self._reply(*outer.route(self.path, None))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                self._reply(*outer.route(self.path, body))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def checksum(self) -> str:
        h = hashlib.sha256()
        for n in sorted(self.views):
            h.update(self.views[n].detach().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def route(self, path: str, body):  # noqa: C901 - one branch per route, as in http_server.py
        self.log.append(path)
        time.sleep(self.delay_s)
        ok = {"success": True, "message": "Success"}
        if path == "/health":
            return 200, None
        if path == "/server_info":
            return 200, {"tp_size": 1}
        if path == "/openapi.json":
            routes = ["/generate", "/update_weights_from_tensor", "/weights_checker"]
            return 200, {"paths": {r: {} for r in routes + (["/begin_weight_update", "/end_weight_update"]
                                                            if self.bracket else [])}}
        if path == "/model_info":
            return 200, {"weight_version": self.version}
        if path == "/begin_weight_update" and self.bracket:
            self.in_bracket = True
            return 200, ok
        if path == "/end_weight_update" and self.bracket:
            self.in_bracket = False
            return 200, ok
        if path == "/update_weights_from_tensor":
            if self.bracket and not self.in_bracket:
                return 400, {"success": False, "message": "tensor updates need begin_weight_update"}
            if self.fail_next_update:
                self.fail_next_update = False
                return 400, {"success": False, "message": "injected failure"}
            assert len(body["serialized_named_tensors"]) == 1  # one payload per TP rank
            named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))
            with torch.no_grad():
                for n, t in named:
                    self.views[n].copy_(t)  # in place, as SGLang's loaders do
            return 200, ok
        if path == "/update_weights_from_disk":
            f = os.path.join(body["model_path"], "model.safetensors")
            if not os.path.exists(f):
                return 400, {"success": False, "message": f"no checkpoint at {body['model_path']}"}
            from safetensors.torch import load_file

            with torch.no_grad():
                for n, t in load_file(f).items():
                    self.views[n].copy_(t)
            if body.get("weight_version") is not None:
                self.version = body["weight_version"]
            return 200, ok
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, ok
        if path == "/weights_checker":
            return 200, {"success": True, "message": "", "per_engine_checksum": self.checksum()}
        if path == "/flush_cache":
            return 200, None
        if path in ("/release_memory_occupation", "/resume_memory_occupation"):
            tags = body.get("tags") or list(self.TAGS)
            if path.startswith("/release"):
                if self.busy:
                    return 400, {"error": {"message": "release_memory_occupation should be called only when idle"}}
                self.released |= set(tags)
                if "weights" in tags:
                    with torch.no_grad():
                        for p in self.model.parameters():
                            p.zero_()  # no CPU backup: the contents are lost
            else:
                missing = [t for t in tags if t not in self.released]
                if missing:
                    return 400, {"error": {"message": f"KeyError: {missing[0]!r}"}}
                self.released -= set(tags)
            return 200, None
        if path == "/generate":
            return 200, self.generate(body)
        return 404, {"detail": "Not Found"}

    @torch.no_grad()
    def generate(self, body):
        single = body["input_ids"] and isinstance(body["input_ids"][0], int)
        outs = []
        for ids in [body["input_ids"]] if single else body["input_ids"]:
            ids = list(ids)
            lp = torch.log_softmax(self.model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            rows = [[None, ids[0], None]] + [[lp[i - 1, ids[i]].item(), ids[i], None] for i in range(1, len(ids))]
            out_ids, out_lp = [], []
            for _ in range(body["sampling_params"]["max_new_tokens"]):
                last = torch.log_softmax(self.model(input_ids=torch.tensor([ids + out_ids])).logits[0, -1].double(), -1)
                tok = int(last.argmax())
                out_ids.append(tok)
                out_lp.append([last[tok].item(), tok, None])
            meta = {"output_token_logprobs": out_lp}
            if body.get("logprob_start_len") == 0:
                meta["input_token_logprobs"] = rows
            outs.append({"output_ids": out_ids, "meta_info": meta})
        return outs[0] if single else outs


def _weights(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {n: v.detach().clone() for n, v in hf_checkpoint_views(build_hf_model(SPEC)).items()}


def _reference_logprobs(w: dict[str, torch.Tensor]) -> torch.Tensor:
    ref = build_hf_model(SPEC)
    views = hf_checkpoint_views(ref)
    with torch.no_grad():
        for n, t in w.items():
            views[n].copy_(t)
        lp = torch.log_softmax(ref(input_ids=torch.tensor([PROMPT])).logits[0, :-1].double(), -1)
    return lp.gather(-1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def _sha(w: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for n in sorted(w):
        h.update(w[n].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bracket", [False, True], ids=["0.5.17-no-bracket", "0.5.21-bracket"])
def test_http_adapter_publish_verify_residency_and_errors(bracket, tmp_path):
    server = ContractServer(SPEC, bracket=bracket)
    try:
        eng = SGLangHTTPEngine(server.url, spec=SPEC, dtype=torch.float32, ipc="cpu", timeout_s=30)
        assert eng.has_bracket is bracket and eng.tp_size == 1 and eng.health()
        pub = Publisher(eng, PublishConfig(bucket_bytes=16 << 10), share_min_bytes=None)
        assert pub.transport == "shm"
        w1 = _weights(1)
        rep = pub.publish(w1, version=1)
        assert rep.num_buckets > 2 and rep.verify == "version-only"
        assert eng.weight_version() == 1 and server.version == "1"  # stamped on the server, read back
        assert eng.last_checksum == server.checksum() == _sha(w1)  # bit-exact in the server's model
        got = torch.tensor(eng.prompt_logprobs(PROMPT), dtype=torch.float64)
        assert (got - _reference_logprobs(w1)).abs().max().item() <= 1e-5
        n_updates = server.log.count("/update_weights_from_tensor")
        assert n_updates == rep.num_buckets

        # in place: the tensors are views of one shared-memory storage, handed over unpacked
        w2 = _weights(2)
        flat = torch.empty(sum(t.numel() for t in w2.values())).share_memory_()
        inplace, off = {}, 0
        for n, t in w2.items():
            inplace[n] = flat[off: off + t.numel()].view(t.shape).copy_(t)
            off += t.numel()
        direct = Publisher(eng, PublishConfig(bucket_bytes=16 << 10), share_min_bytes=1)
        direct.last_good = 1
        rep = direct.publish(inplace, version=2)
        assert rep.num_shared == 1 and rep.num_buckets == 0
        assert server.checksum() == _sha(w2) and eng.weight_version() == 2
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
        assert server.checksum() != _sha(w2)  # contents lost with the release
        direct.last_good = 3
        direct.publish(inplace, version=4)
        eng.resume_memory()
        assert not server.released and eng.resume_memory() == {}
        assert server.checksum() == _sha(w2)
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
        assert eng.weight_version() == 6 and server.checksum() == _sha(w1)

        server.delay_s = 0.5
        eng.timeout_s = 0.1
        with pytest.raises(ReceiverTimeout):
            eng.weight_version()
        server.delay_s, eng.timeout_s = 0.0, 30
    finally:
        server.close()
    with pytest.raises(ReceiverDied):
        eng.weight_version()


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
    eng = SGLangHTTPEngine.launch(spec=spec, log_path=os.path.join(log_dir, "sglang_http_server.log"), env=env,
                                  start_timeout_s=300, **args)
    try:
        import sglang.srt.entrypoints.engine as sgl_engine_mod

        assert eng.has_bracket is hasattr(sgl_engine_mod.Engine, "begin_weight_update")  # same release
        c0 = eng.checksum()
        pub = Publisher(eng, PublishConfig(bucket_bytes=1 << 20))
        rep = pub.publish({n: t.cuda() for n, t in new.items()}, version=1)
        assert rep.num_buckets >= 2 and eng.weight_version() == 1
        c1 = eng.last_checksum
        assert c1 != c0
        eng.restore_from_disk(str(tmp_path / "new"), version=1)
        eng._post("/flush_cache", {})
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
