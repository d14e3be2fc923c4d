"""The SGLang adapter's logic on CPU against a stand-in engine that enforces the documented
SGLang rules (idle-only release, ``KeyError`` when resuming an unreleased tag, the 0.5.21
begin/end bracket, CUDA-only tensors). The real engine runs the same adapter on the GPU lane:
``tests/colocate/test_sglang_gpu.py``."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from colocate import HFModelSpec, NotResidentError, PublishConfig, SGLangEngine
from colocate.buckets import plan_buckets
from colocate.errors import BusyError, ConfigError, ReceiverDied, ReceiverTimeout, TransportError, UpdateError
from colocate.publish import Publisher, PublishError
from colocate.sglang_clients import EngineClient

SPEC = HFModelSpec(arch="qwen3", num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                   head_dim=4, ffn_hidden_size=16, vocab_size=32)


class RuleEngine:
    """Follows SGLang's documented behaviour for the calls the adapter makes."""

    def __init__(self, *, bracket: bool):
        self.released: set[str] = set()
        self.busy = False
        self.calls: list[str] = []
        self.in_bracket = False
        if bracket:
            self.begin_weight_update = self._begin
            self.end_weight_update = self._end
        self.bracket = bracket

    def release_memory_occupation(self, tags=None):
        assert not self.busy, "release while busy"  # SGLang asserts idleness
        for t in tags:
            self.released.add(t)
        self.calls.append(f"release:{','.join(tags)}")

    def resume_memory_occupation(self, tags=None):
        for t in tags:
            if t not in self.released:
                raise KeyError(t)  # SGLang raises for a tag that was not released
            self.released.discard(t)
        self.calls.append(f"resume:{','.join(tags)}")

    def _begin(self, selector="all"):
        self.in_bracket = True
        self.calls.append("begin")
        return True, "ok"

    def _end(self):
        self.in_bracket = False
        self.calls.append("end")
        return True, "ok"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        if self.bracket and not self.in_bracket:
            return False, "tensor updates need begin_weight_update"
        if "weights" in self.released:
            return False, "weights released"
        assert not (flush_cache and self.busy), "Cache flush failed after updating weights"  # SGLang's scheduler
        self.calls.append(f"update:{len(named_tensors)}" + ("+flush" if flush_cache else ""))
        return True, "Success"

    def flush_cache(self):
        self.calls.append("flush")

    def update_weights_from_disk(self, model_path, load_format=None):
        self.calls.append(f"disk:{model_path}")
        return (True, "ok") if model_path.startswith("/ok") else (False, "no such checkpoint")


@pytest.mark.parametrize("bracket", [False, True], ids=["0.5.17-no-bracket", "0.5.21-bracket"])
def test_bracket_detection_versions_and_residency(bracket):
    eng = RuleEngine(bracket=bracket)
    sums = iter(range(100))
    ad = SGLangEngine(EngineClient(eng, checksum_fn=lambda e: f"sum{next(sums)}"), spec=SPEC, commit_checksum=True)
    assert ad.has_bracket is bracket and ad.capabilities() == {"cuda_ipc"}
    if not torch.cuda.is_available():  # the probe refuses: SGLang takes CUDA tensors only
        with pytest.raises(TransportError, match="no common transport"):
            Publisher(ad, PublishConfig())

    ad.begin_update(1)
    entries = plan_buckets([("model.norm.weight", (8,), torch.bfloat16)], bucket_bytes=1 << 20)[0]
    with pytest.raises(UpdateError, match="CUDA tensors only"):
        ad.load_bucket(entries, torch.zeros(512, dtype=torch.uint8))
    ad.end_update(1)
    assert ad.weight_version() == 1 and ad.last_checksum == "sum0"
    assert eng.calls == (["begin", "end", "flush"] if bracket else ["flush"])
    with pytest.raises(UpdateError, match=r"end_update\(2\) without a matching"):
        ad.end_update(2)

    # residency: idempotent on our side, so SGLang never sees a double release/resume
    ad.release_memory(["kv_cache", "weights", "cuda_graph"])
    assert ad.release_memory(["weights"]) == {} and ad.resume_memory(["cuda_graph"]) != {}
    assert ad.resume_memory(["cuda_graph"]) == {}
    with pytest.raises(NotResidentError):
        ad.begin_update(2)
    ad.resume_memory(["weights"])
    ad.begin_update(2)
    ad.end_update(2)  # KV pool released: no flush
    assert eng.calls[-1] != "flush"
    ad.resume_memory()
    assert not eng.released and [c for c in eng.calls if c.startswith("release")] == \
        ["release:kv_cache", "release:weights", "release:cuda_graph"]

    eng.busy = True  # generating: the adapter refuses before SGLang would assert
    with ad.residency.busy(), pytest.raises(Exception, match="refused while busy"):
        ad.release_memory(["kv_cache"])
    eng.busy = False

    ad.begin_update(3)
    ad.abort_update(3)
    assert ad.weight_version() is None  # in-place loads may be half-applied: no valid version
    with pytest.raises(UpdateError, match="no such checkpoint"):
        ad.restore_from_disk("/missing")
    ad.restore_from_disk("/ok/ckpt", version=2)
    assert ad.weight_version() == 2


def test_write_hf_checkpoint_loads_in_transformers_and_replaces_atomically(tmp_path):
    import json

    from transformers import AutoModelForCausalLM

    from colocate.engines import build_hf_model, hf_checkpoint_views
    from colocate.sglang_engine import write_hf_checkpoint

    moe = HFModelSpec(arch="qwen3_moe", num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=1,
                      head_dim=8, ffn_hidden_size=24, vocab_size=32, num_experts=3, tie_embeddings=True)
    for seed in (0, 1):  # the second write replaces the first folder
        torch.manual_seed(seed)
        model = build_hf_model(moe, dtype=torch.bfloat16)
        w = {n: v.clone() for n, v in hf_checkpoint_views(model).items()}
        write_hf_checkpoint(tmp_path / "ckpt", hf_checkpoint_views(model), spec=moe)  # views of fused experts
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary folder left
    views = hf_checkpoint_views(AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16))
    assert set(views) == set(w) and all(torch.equal(views[n], w[n]) for n in w)
    # SGLang's Qwen3-MoE does not tie: the folder carries the embedding again as its lm_head
    from safetensors.torch import load_file

    on_disk = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert set(on_disk) == set(w) | {"lm_head.weight"}
    assert torch.equal(on_disk["lm_head.weight"], w["model.embed_tokens.weight"])


def test_tied_moe_head_is_sent_to_sglang_as_lm_head():
    from dataclasses import replace

    from colocate.sglang_engine import sglang_named_tensors

    moe = HFModelSpec(arch="qwen3_moe", num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                      head_dim=4, ffn_hidden_size=16, vocab_size=32, num_experts=2, tie_embeddings=True)
    emb, norm = torch.randn(32, 8), torch.randn(8)
    named = [("model.norm.weight", norm), ("model.embed_tokens.weight", emb)]
    out = sglang_named_tensors(named, moe)
    assert [n for n, _ in out] == ["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"]
    assert out[2][1] is emb  # the same tensor, no copy
    assert sglang_named_tensors(named[:1], moe) == named[:1]  # a bucket without the embedding
    assert sglang_named_tensors(named, replace(moe, tie_embeddings=False)) == named
    assert sglang_named_tensors(named, replace(SPEC, tie_embeddings=True)) == named  # dense Qwen3 ties in SGLang


def test_prompt_logprob_rows_are_checked_for_alignment():
    from colocate.sglang_engine import logprobs_of_prompt

    rows = [(None, 4, None), (-1.5, 7, None), (-0.25, 9, None)]
    assert logprobs_of_prompt(rows, [4, 7, 9]) == [-1.5, -0.25]
    with pytest.raises(UpdateError, match="row 1: token 7 != prompt token 8"):
        logprobs_of_prompt(rows, [4, 8, 9])
    with pytest.raises(UpdateError, match="3 input log-prob rows for a 2-token prompt"):
        logprobs_of_prompt(rows, [4, 7])


def _import_megatron_core(q) -> None:  # runs in a spawned child, as SGLang's scheduler does
    import sys

    try:
        import megatron.core  # noqa: F401

        q.put("imported")
    except ImportError as e:
        q.put(f"ImportError: {e} | {sys.path[0]}")


def test_launch_hides_megatron_from_spawned_engine_processes(monkeypatch):
    """SGLang's scheduler imports ``megatron.core`` when it can, which switches torch_memory_saver
    to a hook mode that cannot pause CUDA graphs. ``launch`` starts the engine with the stand-in
    directory first on ``sys.path``: a child spawned during ``Engine(...)`` (as SGLang spawns its
    schedulers) cannot import Megatron; this process's ``sys.path`` is restored afterwards."""
    import multiprocessing as mp
    import sys
    import types

    from colocate.sglang_engine import hide_megatron_dir

    seen = {}

    class SpawningEngine(RuleEngine):
        def __init__(self, **kw):
            super().__init__(bracket=False)
            seen["kw"], seen["path0"] = kw, sys.path[0]
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=_import_megatron_core, args=(q,))
            p.start()
            seen["child"] = q.get(timeout=120)
            p.join(30)

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=SpawningEngine))
    path_before = list(sys.path)
    ad = SGLangEngine.launch(spec=SPEC, model_path="/m", tp_size=1)
    shadow = hide_megatron_dir()
    assert seen["kw"] == {"model_path": "/m", "tp_size": 1} and seen["path0"] == shadow
    assert seen["child"].startswith("ImportError: megatron is hidden") and seen["child"].endswith(shadow), seen
    assert sys.path == path_before and isinstance(ad, SGLangEngine)

    seen.clear()
    SGLangEngine.launch(spec=SPEC, hide_megatron=False, model_path="/m")
    assert seen["path0"] != shadow and seen["child"] == "imported"  # the check can fail: Megatron is installed


def test_sglang_process_env_puts_the_stand_in_first(tmp_path):
    import subprocess
    import sys

    from colocate.sglang_engine import hide_megatron_dir, sglang_process_env

    env = sglang_process_env({"PYTHONPATH": str(tmp_path), "MCD_X": "1", "HOME": None})
    assert env["PYTHONPATH"].split(":") == [hide_megatron_dir(), str(tmp_path)]
    assert env["MCD_X"] == "1" and "HOME" not in env
    assert "PYTHONPATH" not in sglang_process_env({"PYTHONPATH": None}, hide_megatron=False)
    out = subprocess.run([sys.executable, "-c", "import megatron.core"], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "megatron is hidden from this SGLang process" in out.stderr


def test_abort_of_a_committed_version_leaves_no_valid_version():
    """SGLang loads in place, so a version the publisher gives up on after ``end_update`` (a
    read-back that failed, an acknowledgement that came too late) cannot be rolled back: the
    adapter stops reporting it, and an older abort does not touch a newer version."""
    eng = RuleEngine(bracket=True)
    ad = SGLangEngine(EngineClient(eng, checksum_fn=lambda e: "c"), spec=SPEC)
    ad.begin_update(1)
    ad.end_update(1)
    assert ad.weight_version() == 1
    ad.abort_update(1)
    assert ad.weight_version() is None and not eng.in_bracket
    ad.begin_update(2)
    ad.end_update(2)
    ad.abort_update(1)
    assert ad.weight_version() == 2


def _cpu_adapter(eng, **kw) -> SGLangEngine:
    """The adapter over ``eng`` taking CPU shared-memory tensors (as a CPU server would), so the
    publisher's hand-overs reach ``load_bucket`` on a machine without CUDA."""
    client = EngineClient(eng, checksum_fn=lambda e: "c", **kw)
    client.ipc = "cpu"
    return SGLangEngine(client, spec=SPEC, dtype=torch.float32)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    from colocate.convert import hf_param_specs

    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, (s, _) in hf_param_specs(SPEC, dtype=torch.float32).items()}


@pytest.mark.parametrize("bracket", [False, True], ids=["0.5.17-no-bracket", "0.5.21-bracket"])
def test_last_load_carries_the_cache_flush(bracket):
    """The adapter holds each load back until the next one (or ``end_update``) arrives, so the
    last load of a publish goes with ``flush_cache=True`` (SGLang flushes in the same call,
    without the separate ``flush_cache`` request, which also empties torch's allocator cache).
    With the 0.5.21 bracket the flush follows ``end_weight_update``; with the KV pool released
    there is nothing to flush."""
    eng = RuleEngine(bracket=bracket)
    ad = _cpu_adapter(eng)
    pub = Publisher(ad, PublishConfig(bucket_bytes=1 << 10), share_min_bytes=None)
    rep = pub.publish(_weights(1), version=1)
    updates = [c for c in eng.calls if c.startswith("update")]
    assert rep.num_buckets >= 3 and len(updates) == rep.num_buckets
    if bracket:
        assert eng.calls[0] == "begin" and eng.calls[-2:] == ["end", "flush"]
        assert not any(c.endswith("+flush") for c in updates)
    else:
        assert updates[-1].endswith("+flush") and not any(c.endswith("+flush") for c in updates[:-1])
        assert "flush" not in eng.calls
    assert ad.weight_version() == 1 and ad.last_checksum is None  # no checksum at commit unless asked

    ad.release_memory(["kv_cache"])
    eng.calls.clear()
    pub.publish(_weights(2), version=2)
    assert not any("flush" in c for c in eng.calls), eng.calls
    ad.resume_memory(["kv_cache"])

    # a failure in the middle: the held-back load is dropped, the version poisoned
    eng.calls.clear()
    real = eng.update_weights_from_tensor
    eng.update_weights_from_tensor = lambda **kw: (False, "injected")
    with pytest.raises(PublishError) as ei:
        pub.publish(_weights(3), version=3)
    assert "injected" in str(ei.value.cause) and 3 in pub.poisoned and ad.weight_version() is None
    assert ad._pending is None and not eng.in_bracket
    eng.update_weights_from_tensor = real
    pub.publish(_weights(4), version=4)
    assert ad.weight_version() == 4


def test_publish_refused_while_the_adapter_generates():
    eng = RuleEngine(bracket=False)
    ad = _cpu_adapter(eng)
    pub = Publisher(ad, PublishConfig(bucket_bytes=1 << 10), share_min_bytes=None)
    with ad.residency.busy():
        with pytest.raises(PublishError) as ei:
            pub.publish(_weights(1), version=1)
    assert isinstance(ei.value.cause, BusyError) and ei.value.phase == "begin"
    assert not any(c.startswith("update") for c in eng.calls)


class HangingEngine(RuleEngine):
    """A scheduler that stops answering (hung, or SIGKILLed: nobody replies) in ``generate``."""

    def __init__(self):
        super().__init__(bracket=False)
        self.gate = threading.Event()
        self.shut = False

    def generate(self, **kw):
        self.gate.wait(30)
        return [{"output_ids": [1]}]

    def shutdown(self):
        self.shut = True
        self.gate.set()


def test_in_process_engine_calls_have_a_deadline():
    eng = HangingEngine()
    ad = _cpu_adapter(eng, call_timeout_s=0.3)
    assert ad.client.checksum() == "c"  # calls that return in time go through the helper thread
    t0 = time.monotonic()
    with pytest.raises(ReceiverTimeout, match="generate did not return within 0.3s"):
        ad.generate([[1, 2, 3]], max_new_tokens=4)
    assert time.monotonic() - t0 < 3.0
    with pytest.raises(ReceiverDied, match="unusable"):  # its loop is still inside the abandoned call
        ad.client.checksum()
    pub = Publisher(ad, PublishConfig(bucket_bytes=1 << 10), share_min_bytes=None)
    with pytest.raises(PublishError) as ei:
        pub.publish(_weights(1), version=1)
    assert isinstance(ei.value.cause, ReceiverDied) and 1 in pub.poisoned
    ad.shutdown()
    assert eng.shut
    with pytest.raises(ConfigError, match="call_timeout_s must be > 0"):
        EngineClient(eng, call_timeout_s=0)
    # without a deadline the call is made directly (no thread)
    direct = EngineClient(RuleEngine(bracket=False), checksum_fn=lambda e: threading.current_thread().name)
    assert direct.checksum() == threading.current_thread().name


def test_flattened_payload_metadata_and_tied_moe_alias():
    """The ``flattened_bucket`` payload names every entry with its byte span in the buffer
    (the buffer itself, as bytes); a tied Qwen3-MoE's embedding is named again as
    ``lm_head.weight`` over the same bytes (SGLang's MoE keeps its own head)."""
    from colocate.sglang_clients import flattened_bucket

    moe = HFModelSpec(arch="qwen3_moe", num_layers=1, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                      head_dim=4, ffn_hidden_size=16, vocab_size=32, num_experts=2, tie_embeddings=True)
    entries = plan_buckets([("model.norm.weight", (8,), torch.bfloat16),
                            ("model.embed_tokens.weight", (32, 8), torch.bfloat16)], bucket_bytes=1 << 20)[0]
    buf = torch.randn(4096).to(torch.bfloat16)
    p = flattened_bucket(buf, entries)
    assert p["flattened_tensor"].dtype == torch.uint8 and p["flattened_tensor"].data_ptr() == buf.data_ptr()
    for m, e in zip(p["metadata"], entries, strict=True):
        assert (m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx - m.start_idx) == \
            (e.name, e.shape, e.dtype, e.offset, e.nbytes)
        view = p["flattened_tensor"][m.start_idx: m.end_idx].view(m.dtype).reshape(m.shape)  # as SGLang rebuilds
        assert torch.equal(view, buf.view(torch.uint8)[e.offset: e.offset + e.nbytes].view(e.dtype).view(e.shape))

    sent = []

    class Client:
        ipc, owner, allocator, has_bracket = "cpu", "fake", "default", False

        def update_weights_from_bucket(self, payload, *, flush_cache):
            sent.append(([m.name for m in payload["metadata"]], flush_cache))

        def set_weight_version(self, v):
            pass

    ad = SGLangEngine(Client(), spec=moe, flattened=True)
    ad.begin_update(1)
    ad.load_bucket(entries, buf.view(torch.uint8))
    ad.end_update(1)
    assert sent == [(["model.norm.weight", "model.embed_tokens.weight", "lm_head.weight"], True)]


def test_in_process_start_failure_is_typed_and_kills_what_it_started(monkeypatch):
    """``sglang.Engine(...)`` raising during start (as for a model path without a checkpoint,
    after its scheduler processes were spawned): ``EngineStartError`` naming the model path, and
    the processes the start had spawned (children and their children) are gone."""
    import subprocess
    import sys
    import types

    from colocate.errors import EngineStartError

    from .test_workers import _gone

    spawned = []

    class FailingEngine:
        def __init__(self, **kw):
            # a "scheduler" that itself started a "detokenizer"
            p = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                                  "q = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
                                  "print(q.pid, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
            spawned.extend([p.pid, int(p.stdout.readline())])
            raise OSError(f"{kw['model_path']} does not appear to have a file named config.json")

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=FailingEngine))
    with pytest.raises(EngineStartError, match=r"model_path='/no/such/ckpt'.*config.json.*killed the 1 process"):
        SGLangEngine.launch(spec=SPEC, model_path="/no/such/ckpt")
    assert len(spawned) == 2 and all(_gone(p) for p in spawned), spawned


def test_in_process_start_has_a_deadline_and_drops_the_launcher_env(monkeypatch):
    """``sglang.Engine(...)`` waits for its schedulers as long as they live (SGLang 0.5.17 polls
    their pipes every 5 s). The stand-in does the same with a "scheduler" that never reports: the
    start deadline SIGKILLs what the start spawned, the engine's own wait sees it die, and the
    start fails with ``EngineStartError`` naming ``start_timeout_s``, nothing left running. The
    spawned processes see this process's environment without torchrun's per-rank variables
    (``TORCHELASTIC_USE_AGENT_STORE=True`` blocks SGLang's own rendezvous); it is restored after."""
    import subprocess
    import sys
    import time
    import types

    from colocate.errors import EngineStartError

    from .test_workers import _gone

    seen = {}

    class HangingEngine:
        def __init__(self, **kw):
            seen["env"] = {k: os.environ.get(k) for k in ("TORCHELASTIC_USE_AGENT_STORE", "RANK", "MCD_KEEP")}
            p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the scheduler
            seen["pid"] = p.pid
            while p.poll() is None:  # as _wait_for_scheduler_ready: wait while it lives
                time.sleep(0.05)
            raise RuntimeError(f"Rank 0 scheduler died during initialization (exit code: {p.returncode})")

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=HangingEngine))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MCD_KEEP", "1")
    t0 = time.monotonic()
    with pytest.raises(EngineStartError, match=r"not started within start_timeout_s=1.0s.*exit code: -9.*killed the 1"):
        SGLangEngine.launch(spec=SPEC, model_path="/m", start_timeout_s=1.0)
    assert time.monotonic() - t0 < 30 and _gone(seen["pid"])
    assert seen["env"] == {"TORCHELASTIC_USE_AGENT_STORE": None, "RANK": None, "MCD_KEEP": "1"}
    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True" and os.environ["RANK"] == "3"  # restored

    class QuickEngine(RuleEngine):
        def __init__(self, **kw):
            super().__init__(bracket=False)

    monkeypatch.setitem(sys.modules, "sglang", types.SimpleNamespace(Engine=QuickEngine))
    assert isinstance(SGLangEngine.launch(spec=SPEC, model_path="/m", start_timeout_s=30.0), SGLangEngine)
    with pytest.raises(ConfigError, match="start_timeout_s must be > 0"):
        SGLangEngine.launch(spec=SPEC, model_path="/m", start_timeout_s=0)
