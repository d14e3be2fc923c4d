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

Run: ``python -m mopd.hf_server --model-dir DIR --port P [--mode sglang-0.5.17]``. It also
stands in for ``sglang.launch_server`` under :meth:`colocate.sglang_clients.HTTPClient.launch`
(``server_module="mopd.hf_server"``): ``--model-path`` is accepted, SGLang's other flags are
ignored (named on stderr), and ``GET /server_info`` answers ``tp_size`` 1.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

__all__ = ["MODES", "REPLY_FAULTS", "HFTeacherServer", "ServerFaults"]

MODES = ("reference", "sglang-0.5.17")


REPLY_FAULTS = ("stall", "trickle", "reset", "truncated", "bad_status", "bad_json", "bad_utf8", "bad_entry",
                "short_entries", "extra_results")


@dataclass(kw_only=True)
class ServerFaults:
    """Injected faults for tests of the client's error handling (``/generate`` unless noted)."""

    delay_s: float = 0.0
    """Sleep before answering ``/generate``."""
    fail_first: int = 0
    """Answer the first N requests (any path, or only ``fail_path``) with HTTP 503."""
    fail_path: str | None = None
    """Restrict ``fail_first`` to this path (e.g. ``/generate``)."""
    status: int = 0
    """Answer every ``/generate`` with this HTTP status (and a JSON error body); 0 = off."""
    reply: str = ""
    """Break the reply of every ``/generate`` (one of ``REPLY_FAULTS``): ``stall`` reads the
    request and never answers; ``trickle`` sends the whole reply, status line included, one byte
    every ``trickle_s``; ``reset`` closes the connection with a TCP RST; ``truncated`` sends half
    of the announced ``Content-Length``; ``bad_status`` a garbled status line; ``bad_json`` /
    ``bad_utf8`` a body that is not JSON / not UTF-8; ``bad_entry`` replaces one log-prob entry
    by a string; ``short_entries`` drops the last entry of row 0; ``extra_results`` adds a row."""
    trickle_s: float = 0.4
    """Seconds between bytes of a ``trickle`` reply."""
    nan_at: tuple[int, int] | None = None
    """(row, token position) whose returned log-prob is NaN."""
    logprob_at: tuple[int, int, float] | None = None
    """(row, token position, value): return this log-prob there (−inf, +inf, a positive value)."""
    wrong_id_at: tuple[int, int, int] | None = None
    """(row, token position, reported id): report this id there instead (a misaligned server)."""

    def __post_init__(self) -> None:
        if self.reply and self.reply not in REPLY_FAULTS:
            raise ValueError(f"ServerFaults.reply must be one of {REPLY_FAULTS}, got {self.reply!r}")


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
        self._stopping = threading.Event()
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
                    if server.faults.fail_path in (None, self.path):
                        server.requests += 1
                    n = server.requests
                if server.faults.fail_path in (None, self.path) and n <= server.faults.fail_first:
                    self._send(503, {"error": "injected 503"})
                    return True
                return False

            def _broken_reply(self, result: Any) -> None:
                """Send ``result`` the way ``faults.reply`` breaks it (see :class:`ServerFaults`)."""
                kind, conn = server.faults.reply, self.connection
                self.close_connection = True
                if kind == "stall":
                    server._stopping.wait()
                    return
                if kind == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    conn.close()  # RST instead of FIN
                    return
                if kind == "bad_status":
                    conn.sendall(b"HTTQ/1.1 2OO OK\r\n\r\n")
                    return
                rows = result if isinstance(result, list) else [result]
                if kind == "bad_entry":
                    rows[0]["meta_info"]["input_token_logprobs"][1] = "oops"
                elif kind == "short_entries":
                    rows[0]["meta_info"]["input_token_logprobs"].pop()
                elif kind == "extra_results":
                    rows.append(rows[0])
                body = json.dumps(rows if isinstance(result, list) else rows[0]).encode()
                if kind == "bad_json":
                    body = body[: len(body) // 2]
                elif kind == "bad_utf8":
                    body = b"\xff\xfe" + body
                head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                        "Connection: close\r\n\r\n").encode()
                if kind == "truncated":
                    conn.sendall(head + body[: len(body) // 2])
                elif kind == "trickle":
                    for i in range(len(head + body)):
                        if server._stopping.wait(server.faults.trickle_s):
                            return
                        try:
                            conn.sendall((head + body)[i: i + 1])
                        except OSError:  # the client gave up
                            return
                else:
                    conn.sendall(head + body)

            def do_GET(self):
                if self._fault():
                    return
                if self.path == "/health":
                    self._send(200, {})
                elif self.path == "/server_info":  # what an SGLang client reads at connect
                    self._send(200, {"tp_size": 1, "server": "mopd.hf_server"})
                else:
                    self._send(404, {"error": self.path})

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
                if server.faults.status:
                    return self._send(server.faults.status, {"error": f"injected {server.faults.status}"})
                if server.faults.reply:
                    return self._broken_reply(result)
                self._send(200, result)

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="mopd-hf-server", daemon=True)

    def start(self) -> HFTeacherServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # ends stalled and trickling replies
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
                if self.faults.logprob_at is not None and self.faults.logprob_at[:2] == (r, pos):
                    value = self.faults.logprob_at[2]
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
    ap.add_argument("--model-dir", "--model-path", dest="model_dir", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--mode", choices=MODES, default="reference")
    # started in sglang.launch_server's place (colocate.SGLangEngine/HTTPClient.launch with
    # server_module="mopd.hf_server"), it gets SGLang's flags too: they do not apply here
    args, ignored = ap.parse_known_args(argv)
    if ignored:
        print(f"mopd.hf_server: ignoring SGLang server flags {ignored}", file=sys.stderr, flush=True)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    server = HFTeacherServer(model, host=args.host, port=args.port, mode=args.mode)
    print(f"serving {args.model_dir} at {server.url}", flush=True)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
