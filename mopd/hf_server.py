"""A reference teacher server: a transformers causal LM behind the SGLang ``/generate`` and
``/health`` contract that :class:`mopd.backends.HTTPTeacher` uses (CPU tests, debugging).

Contract implemented (subset of SGLang's native API): POST ``/generate`` with ``input_ids``
(one list or a list of lists), ``sampling_params`` (``temperature``, ``max_new_tokens`` 0 or
1, greedy), ``return_logprob`` and ``logprob_start_len`` (int or per row). Each result has
``meta_info.input_token_logprobs = [[logprob | None, token_id, None], ...]`` for token
positions ``logprob_start_len .. len−1``: the log-prob of that token given its prefix under
softmax(logits / temperature); the first entry is always ``None`` (as SGLang pads it). Unlike
SGLang's default, log-probs are scaled by the request temperature.

``mode="sglang-0.5.17"`` reproduces SGLang 0.5.17's reply exactly where it differs (read from
its source: ``scheduler_components/logprob_result_processor.py`` and ``schedule_batch.py``):

* input-token log-probs are plain ``log_softmax(logits)``: the request temperature scales only
  sampling and output-token log-probs, never ``input_token_logprobs``;
* the reported token id of every entry is ``id if id < vocab_size − 1 else 0``, so the last
  vocabulary id comes back as 0 (the value is still computed for the true id);
* request ids outside ``[0, vocab_size)`` are rejected (HTTP 400), as its tokenizer manager does.

Run: ``python -m mopd.hf_server --model-dir DIR --port P [--mode sglang-0.5.17]``.
"""

from __future__ import annotations

import argparse
import json
import math
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

__all__ = ["MODES", "HFTeacherServer", "ServerFaults"]

MODES = ("reference", "sglang-0.5.17")


@dataclass(kw_only=True)
class ServerFaults:
    """Injected faults for tests of the client's error handling."""

    delay_s: float = 0.0
    """Sleep before answering ``/generate``."""
    fail_first: int = 0
    """Answer the first N requests (any path) with HTTP 503."""
    nan_at: tuple[int, int] | None = None
    """(row, token position) whose returned log-prob is NaN."""
    wrong_id_at: tuple[int, int, int] | None = None
    """(row, token position, reported id): report this id there instead (a misaligned server)."""


class HFTeacherServer:
    """Serve ``model`` (a transformers causal LM, eval mode) on ``host:port`` in a thread;
    ``mode`` is ``reference`` or ``sglang-0.5.17`` (module docstring)."""

    def __init__(self, model: Any, *, host: str = "127.0.0.1", port: int = 0, faults: ServerFaults | None = None,
                 mode: str = "reference"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.vocab_size = int(model.config.vocab_size)
        self.model = model.eval()
        self.faults = faults or ServerFaults()
        self.requests = 0
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                return

            def _send(self, code: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _fault(self) -> bool:
                with server._lock:
                    server.requests += 1
                    n = server.requests
                if n <= server.faults.fail_first:
                    self._send(503, {"error": "injected 503"})
                    return True
                return False

            def do_GET(self):
                if self._fault():
                    return
                self._send(200, {}) if self.path == "/health" else self._send(404, {"error": self.path})

            def do_POST(self):
                if self._fault():
                    return
                if self.path != "/generate":
                    return self._send(404, {"error": self.path})
                try:
                    req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    result = server.generate(req)
                except (KeyError, ValueError, TypeError) as err:
                    return self._send(400, {"error": f"{type(err).__name__}: {err}"})
                if server.faults.delay_s:
                    time.sleep(server.faults.delay_s)
                self._send(200, result)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="mopd-hf-server", daemon=True)

    def start(self) -> HFTeacherServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> HFTeacherServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @torch.no_grad()
    def generate(self, req: dict) -> Any:
        ids = req["input_ids"]
        single = bool(ids) and isinstance(ids[0], int)
        rows = [ids] if single else ids
        sp = req.get("sampling_params") or {}
        sps = sp if isinstance(sp, list) else [sp] * len(rows)
        starts = req.get("logprob_start_len", 0)
        starts = starts if isinstance(starts, list) else [starts] * len(rows)
        out = []
        for r, (row, p, start) in enumerate(zip(rows, sps, starts)):
            temperature = float(p.get("temperature", 1.0))
            if int(p.get("max_new_tokens", 1)) not in (0, 1):
                raise ValueError("this server generates at most one token")
            if not 0 <= int(start) < len(row):
                raise ValueError(f"logprob_start_len {start} outside [0, {len(row)})")
            sglang = self.mode == "sglang-0.5.17"
            if sglang and any(not 0 <= t < self.vocab_size for t in row):
                raise ValueError(f"input_ids of row {r} hold ids outside [0, {self.vocab_size})")
            x = torch.tensor([row], dtype=torch.long)
            with self._lock:
                logits = self.model(input_ids=x).logits[0].double()
            scale = temperature if temperature > 0 and not sglang else 1.0
            logp = torch.log_softmax(logits / scale, -1)
            entries = []
            for pos in range(int(start), len(row)):
                value = None if pos == int(start) else float(logp[pos - 1, row[pos]])
                if self.faults.nan_at == (r, pos):
                    value = math.nan
                tid = row[pos] if not sglang or row[pos] < self.vocab_size - 1 else 0
                if self.faults.wrong_id_at is not None and self.faults.wrong_id_at[:2] == (r, pos):
                    tid = self.faults.wrong_id_at[2]
                entries.append([value, tid, None])
            nxt = int(logits[-1].argmax())
            out.append({"output_ids": [nxt] if int(p.get("max_new_tokens", 1)) else [],
                        "meta_info": {"input_token_logprobs": entries, "prompt_tokens": len(row)}})
        return out[0] if single else out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--mode", choices=MODES, default="reference")
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    server = HFTeacherServer(model, host=args.host, port=args.port, mode=args.mode)
    print(f"serving {args.model_dir} at {server.url}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
