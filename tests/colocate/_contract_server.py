"""A CPU server implementing SGLang 0.5.17's HTTP contract for the routes the adapter uses (JSON
bodies, base64 ``ForkingPickler`` tensor payloads carrying shared-memory handles, in-place loads,
idle-only release, errors for resuming an unreleased tag, optional 0.5.21 bracket) over a real
``transformers`` model. In process (:class:`ContractServer`) or as ``sglang.launch_server``'s
stand-in: ``python -m tests.colocate._contract_server --host H --port P --model-path DIR [flags]``
loads the HF checkpoint at ``DIR`` and serves until killed (``GET /probe`` reports its pid, argv
and environment, and whether Megatron imports). CPU tensors cross as file descriptors, which the
owner's multiprocessing resource sharer hands only to processes with its authkey: pass it as
``MCD_MP_AUTHKEY`` (hex). The real server takes CUDA tensors (IPC handles) and needs none."""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import pickle
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from colocate import HFModelSpec
from colocate.engines import build_hf_model, hf_checkpoint_views

SPEC = HFModelSpec(arch="qwen3", num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                   head_dim=8, ffn_hidden_size=48, vocab_size=64, rope_theta=10000.0)
"""The model the adapter tests publish into."""


def weights(seed: int) -> dict[str, torch.Tensor]:
    """Random HF-named weights of :data:`SPEC` (a config-built model's init under ``seed``)."""
    torch.manual_seed(seed)
    return {n: v.detach().clone() for n, v in hf_checkpoint_views(build_hf_model(SPEC)).items()}


def sha(w: dict[str, torch.Tensor]) -> str:
    """What :meth:`ContractServer.checksum` returns for a model holding ``w``."""
    h = hashlib.sha256()
    for n in sorted(w):
        h.update(w[n].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _SafeUnpickler(pickle.Unpickler):
    """SGLang's ``SafeUnpickler`` rule for tensor payloads (0.5.17, ``srt/utils/common.py``): only
    classes of allow-listed modules load (here the subset a payload of ours may need)."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "types.", "torch.", "multiprocessing.resource_sharer.",
               "multiprocessing.reduction.")

    def find_class(self, module, name):
        if any((module + ".").startswith(p) for p in self.ALLOWED):
            return super().find_class(module, name)
        raise RuntimeError(f"Blocked unsafe class loading ({module}.{name})")


def _safe_loads(data: bytes):
    return _SafeUnpickler(io.BytesIO(data)).load()


def probe() -> dict:
    try:
        import megatron.core  # noqa: F401

        megatron = "imported"
    except ImportError as e:
        megatron = f"ImportError: {e}"
    keys = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTHONPATH", "COLOCATE_ROLE",
            "MCD_ROLE_VAR", "SGLANG_MEMORY_SAVER_CUDA_GRAPH", "HF_HUB_OFFLINE", "TORCHELASTIC_USE_AGENT_STORE",
            "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    return {"pid": os.getpid(), "ppid": os.getppid(), "argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys},
            "megatron": megatron}


class ContractServer:
    """SGLang's HTTP contract (the routes the adapter uses) over a CPU ``transformers`` model."""

    TAGS = ("kv_cache", "weights", "cuda_graph")

    def __init__(self, spec: HFModelSpec | None = None, *, bracket: bool, model=None, host: str = "127.0.0.1",
                 port: int = 0):
        if model is None:
            torch.manual_seed(0)
            model = build_hf_model(spec)
        self.model = model
        self.views = hf_checkpoint_views(self.model)
        self.bracket, self.in_bracket = bracket, False
        self.released: set[str] = set()
        self.version = "default"
        self.busy = False
        self.fail_next_update = False
        self.delay_s = 0.0
        self.generate_delay_s = 0.0
        self.version_suffix = ""  # injected fault: the stamped version reads back changed
        self.trickle_s = 0.0  # > 0: every reply is written one byte at a time, this far apart
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
                    if outer.trickle_s:
                        for i in range(len(data)):
                            self.wfile.write(data[i:i + 1])
                            self.wfile.flush()
                            time.sleep(outer.trickle_s)
                    else:
                        self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (the timeout case)
                    pass

            def do_GET(self):
                self._reply(*outer.route(self.path, None))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"null")
                self._reply(*outer.route(self.path, body))

        self.httpd = ThreadingHTTPServer((host, port), Handler)
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
        if path == "/server_info":  # memory_usage as SGLang's build_memory_usage writes it (GiB, 3 decimals)
            return 200, {"tp_size": 1, "internal_states": [{"memory_usage": {
                "weight": 0.004, "kvcache": 0.047, "startup_available": 139.5, "token_capacity": 16384,
                "token_capacity_swa": None, "graph": {"decode": 0.002}}}]}
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
            named = _safe_loads(base64.b64decode(body["serialized_named_tensors"][0]))
            if body.get("load_format") == "flattened_bucket":  # SGLang's FlattenedTensorBucket: views of one buffer
                flat = named["flattened_tensor"]
                named = [(m.name, flat[m.start_idx: m.end_idx].view(m.dtype).reshape(m.shape)) for m in named["metadata"]]
                self.log.append("flattened")
            with torch.no_grad():
                for n, t in named:
                    self.views[n].copy_(t)  # in place, as SGLang's loaders do
            if body.get("flush_cache"):
                self.log.append("flush(in update)")
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
            self.version = body["new_version"] + (self.version_suffix if body["new_version"] != "poisoned" else "")
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
            time.sleep(self.generate_delay_s)
            return 200, self.generate(body)
        if path == "/probe":  # what the process was started with (launch tests)
            return 200, probe()
        return 404, {"detail": "Not Found"}

    @torch.no_grad()
    def generate(self, body):
        single = body["input_ids"] and isinstance(body["input_ids"][0], int)
        prompts = [body["input_ids"]] if single else body["input_ids"]
        starts = body.get("logprob_start_len")
        starts = starts if isinstance(starts, list) else [starts] * len(prompts)  # per row, or one for all
        outs = []
        for ids, start in zip(prompts, starts, strict=True):
            ids = list(ids)
            lp = torch.log_softmax(self.model(input_ids=torch.tensor([ids])).logits[0].double(), -1)
            out_ids, out_lp = [], []
            for _ in range(body["sampling_params"]["max_new_tokens"]):
                last = torch.log_softmax(self.model(input_ids=torch.tensor([ids + out_ids])).logits[0, -1].double(), -1)
                tok = int(last.argmax())
                out_ids.append(tok)
                out_lp.append([last[tok].item(), tok, None])
            meta = {"output_token_logprobs": out_lp}
            if start is not None and start >= 0:  # SGLang pads the first entry (token ``start``) with None
                meta["input_token_logprobs"] = [[None, ids[start], None]] + [
                    [lp[i - 1, ids[i]].item(), ids[i], None] for i in range(start + 1, len(ids))]
            outs.append({"output_ids": out_ids, "meta_info": meta})
        return outs[0] if single else outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--bracket", action="store_true")
    ap.add_argument("--generate-delay-s", type=float, default=0.0)  # a long generation (crash tests)
    args, _ = ap.parse_known_args()  # the other sglang flags (tp-size, base-gpu-id, ...) are ignored
    if os.environ.get("MCD_MP_AUTHKEY"):  # shared-memory CPU tensors (file descriptors) come from the owner:
        import multiprocessing  # its resource sharer accepts processes with its authkey only

        multiprocessing.current_process().authkey = bytes.fromhex(os.environ["MCD_MP_AUTHKEY"])
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32, attn_implementation="eager")
    server = ContractServer(bracket=args.bracket, model=model.eval(), host=args.host, port=args.port)
    server.generate_delay_s = args.generate_delay_s
    print(f"serving {server.url}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
