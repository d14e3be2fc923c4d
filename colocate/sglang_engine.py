"""The SGLang rollout engine adapter (``sglang`` imported lazily; the engine runs on the GPU lane).

:class:`SGLangEngine` gives an SGLang engine the receiver and residency surface of
:class:`~colocate.engines.HFEngine`, over one of two thin clients
(:mod:`colocate.sglang_clients`): an in-process ``sglang.Engine`` (:meth:`SGLangEngine.launch`)
or a ``sglang.launch_server`` over HTTP (:meth:`SGLangEngine.connect`,
:meth:`SGLangEngine.launch_server`, the latter a guarded colocated worker of this process).

* ``load_bucket`` hands SGLang one buffer (a packed bucket, or a trainer storage sent in place by
  the publisher) with the byte span of each HF-named tensor in it, as SGLang's
  ``load_format="flattened_bucket"`` (default; one CUDA IPC handle and event for the buffer,
  SGLang rebuilds the tensors as views) or, with ``flattened=False``, as one tensor per name
  through ``load_format=None``. Either way SGLang stacks q/k/v and gate/up and slices per TP rank.
* Each load is held back until the next one arrives; ``end_update`` sends the last with
  ``flush_cache`` (SGLang flushes its radix cache in the same call) — one request fewer.
* The ``begin_weight_update`` / ``end_weight_update`` bracket (mandatory from SGLang 0.5.21,
  absent in 0.5.17) is used when the engine has it — feature-detected, not version-parsed.
* SGLang answers a tensor load after its copies ran (its scheduler drops the received tensors
  first, and torch synchronizes the receiving stream when a CUDA-IPC storage is freed; the GPU
  test and ``bench/publish.py --sglang`` overwrite the source right after the answer and find
  the published bytes in the engine), so no checksum is needed as a device sync at commit
  (``commit_checksum`` reads it anyway). ``unsynced_acks`` stays set: the publisher gives every
  packed bucket a fresh buffer and frees them only after ``end_update`` (conservative).
* SGLang's checker hashes its own (fused) layout, so per-tensor checksums cannot be compared:
  ``verifies_checksums = False``; tests compare the engine checksum against a disk load of the
  same weights and the engine's logprobs against a reference HF model.
* Loads are in place: a failure in the middle, or an abort of a version already committed,
  leaves no valid version (``weight_version()`` is None; a poisoned version is never reported);
  :meth:`SGLangEngine.restore_from_disk` reloads a checkpoint (SGLang rolls back a failed disk load).
* SGLang's processes start with Megatron hidden (:func:`hide_megatron_dir`): SGLang's scheduler
  imports ``megatron.core`` whenever it can (its debug dumper), and importing ``megatron.core``
  sets ``torch_memory_saver.hook_mode = "torch"`` (``inference/contexts/dynamic_context.py``),
  a mode that cannot pause CUDA graphs — so an engine with ``enable_memory_saver`` and CUDA graphs
  died in graph capture wherever Megatron was installed ("Only hook_mode=preload supports
  pauseable CUDA Graph currently"). SGLang needs nothing from Megatron.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from colocate.buckets import Entry, unpack_bucket
from colocate.config import HFModelSpec, SGLangServerConfig
from colocate.convert import check_params, hf_param_specs
from colocate.errors import BusyError, UpdateError
from colocate.residency import ENGINE_TAGS, Residency
from colocate.sglang_clients import EngineClient, HTTPClient, flattened_bucket, sglang_checksum, tag_bytes_of
from mcore_distill.atomic import atomic_write_bytes, publish_directory, temp_directory_for

__all__ = ["SGLangEngine", "hide_megatron_dir", "logprobs_of_prompt", "sglang_checksum", "sglang_engine_args",
           "sglang_named_tensors", "sglang_process_env", "sglang_server_launch_args", "write_hf_checkpoint"]

_MEGATRON_STUB = (
    '"""Stand-in that hides Megatron from SGLang\'s processes (mcore-distill colocate.sglang_engine)."""\n'
    "raise ImportError('megatron is hidden from this SGLang process by mcore-distill: importing megatron.core "
    "would switch torch_memory_saver to hook_mode=\"torch\", which cannot pause CUDA graphs')\n")


def hide_megatron_dir() -> str:
    """A directory whose ``megatron`` package raises ``ImportError`` when imported; put first on
    the path of SGLang's processes (see the module docstring for why). Created once per user
    under the temp directory (the file written atomically, so concurrent creators agree) and reused."""
    base = Path(tempfile.gettempdir()) / f"mcore_distill_hide_megatron_{os.getuid()}"
    init = base / "megatron" / "__init__.py"
    if not init.is_file():
        init.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(init, _MEGATRON_STUB.encode())
    return str(base)


def sglang_process_env(env: dict[str, str | None] | None = None, *, hide_megatron: bool = True) -> dict[str, str]:
    """Environment for an SGLang server process: this process's environment less its launcher's
    per-rank variables, with ``env`` merged over it (``None`` removes a variable) and, with
    ``hide_megatron``, :func:`hide_megatron_dir` first on ``PYTHONPATH`` (SGLang's spawned
    schedulers inherit the server's ``sys.path``); see
    :func:`colocate.sglang_clients.sglang_env_overrides`."""
    from colocate.sglang_clients import sglang_env_overrides

    over = sglang_env_overrides(os.environ, env, hide_megatron=hide_megatron)
    return {k: v for k, v in {**os.environ, **over}.items() if v is not None}


def write_hf_checkpoint(path: str | os.PathLike, tensors: dict[str, torch.Tensor], *, spec: HFModelSpec,
                        dtype: torch.dtype = torch.bfloat16) -> None:
    """Write an HF checkpoint folder SGLang can load (``config.json`` with ``architectures`` and
    ``torch_dtype``, one ``model.safetensors`` with HF names) atomically: everything goes into a
    temporary sibling folder, which then replaces ``path`` (:func:`mcore_distill.atomic.publish_directory`:
    ``path`` is the old or the new complete folder at every instant). A tied Qwen3-MoE also gets
    ``lm_head.weight`` (:func:`sglang_named_tensors`)."""
    import shutil

    from safetensors.torch import save_file

    from colocate.engines import hf_config

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_directory_for(path)
    try:
        cfg = hf_config(spec, dtype=dtype)
        cfg.architectures = ["Qwen3ForCausalLM" if spec.arch == "qwen3" else "Qwen3MoeForCausalLM"]
        cfg.save_pretrained(tmp)
        c = json.loads((tmp / "config.json").read_text())
        c["torch_dtype"] = c["dtype"] = str(dtype).removeprefix("torch.")
        (tmp / "config.json").write_text(json.dumps(c, indent=1))
        # copies: safetensors refuses tensors that share memory (e.g. views of fused experts)
        named = sglang_named_tensors(list(tensors.items()), spec)  # + lm_head of a tied MoE (SGLang)
        save_file({n: t.detach().to(device="cpu", dtype=dtype, copy=True).contiguous() for n, t in named},
                  str(tmp / "model.safetensors"))
        publish_directory(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def sglang_named_tensors(named: list[tuple[str, torch.Tensor]], spec: HFModelSpec) -> list[tuple[str, torch.Tensor]]:
    """The tensors SGLang must receive for ``named``: SGLang's Qwen3-MoE model (0.5.17,
    ``models/qwen3_moe.py``) always owns an ``lm_head`` and ignores ``tie_word_embeddings``, so for
    a tied ``qwen3_moe`` spec the embedding is sent a second time as ``lm_head.weight`` (otherwise
    that head keeps its initial values: constant logits, the same log-probs whatever the weights).
    A model that does tie skips the extra name. Unchanged for every other spec."""
    if spec.arch != "qwen3_moe" or not spec.tie_embeddings:
        return named
    return named + [("lm_head.weight", t) for n, t in named if n == "model.embed_tokens.weight"]


def sglang_engine_args(model_path: str, *, cuda_graph: bool = True, memory_saver: bool = True,
                       **overrides: Any) -> dict[str, Any]:
    """``sglang.Engine`` keyword arguments that run SGLang 0.5.17 from the GPU lane's trimmed
    carry (Triton attention, no tokenizer: token ids in and out). With ``cuda_graph`` the decode
    graphs for batch sizes 1, 2, 4 are captured (prefill graphs off); pausing them with the memory
    saver needs ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` in the environment before the engine starts
    (:meth:`SGLangEngine.launch` and :meth:`SGLangEngine.launch_server` also hide Megatron from
    SGLang's processes, see the module docstring). ``overrides`` replace or add arguments."""
    kw: dict[str, Any] = dict(model_path=model_path, skip_tokenizer_init=True, attention_backend="triton",
                              sampling_backend="pytorch", grammar_backend="none", mem_fraction_static=0.3,
                              max_total_tokens=65536, dtype="bfloat16", random_seed=0, log_level="error",
                              enable_memory_saver=memory_saver)
    if cuda_graph:
        kw.update(disable_cuda_graph=False, cuda_graph_bs_decode=[1, 2, 4], disable_prefill_cuda_graph=True)
    else:
        kw.update(disable_cuda_graph=True)
    kw.update(overrides)
    return kw


def sglang_server_launch_args(config: SGLangServerConfig) -> dict[str, Any]:
    """:meth:`~colocate.sglang_clients.HTTPClient.launch` arguments for ``config``: the server's
    (:func:`sglang_engine_args`, log level ``warning``) and the launch's (role, its environment
    :meth:`~colocate.config.SGLangServerConfig.role_env`, port, devices, deadlines, log)."""
    args = sglang_engine_args(config.model_path, cuda_graph=config.cuda_graph, memory_saver=config.memory_saver,
                              tp_size=config.tp_size, mem_fraction_static=config.mem_fraction_static,
                              max_total_tokens=config.max_total_tokens, log_level="warning")
    return {**args, "role": config.role, "env": config.role_env(), "port": config.port or None,
            "devices": None if config.devices is None else list(config.devices),
            "start_timeout_s": config.start_timeout_s, "timeout_s": config.request_timeout_s,
            "log_path": config.log_path}


def logprobs_of_prompt(rows: Sequence[Sequence[Any]], prompt: Sequence[int]) -> list[float]:
    """SGLang's ``input_token_logprobs`` rows ``(logprob, token_id, text)`` for a prompt scored
    from position 0 → log-probs of tokens 1..T-1. Raises :class:`UpdateError` when the rows do
    not line up with ``prompt`` (count or token ids)."""
    if len(rows) != len(prompt):
        raise UpdateError(f"SGLang returned {len(rows)} input log-prob rows for a {len(prompt)}-token prompt")
    for i, (row, tok) in enumerate(zip(rows, prompt, strict=True)):
        if row[1] is not None and int(row[1]) != int(tok):
            raise UpdateError(f"input log-prob row {i}: token {row[1]} != prompt token {tok} (misaligned)")
    if any(r[0] is None for r in rows[1:]):
        raise UpdateError("SGLang returned no log-prob for a prompt position after the first")
    return [float(r[0]) for r in rows[1:]]


class SGLangEngine:
    """Receiver + residency adapter over an SGLang engine reached through ``client`` (an
    :class:`~colocate.sglang_clients.EngineClient` or :class:`~colocate.sglang_clients.HTTPClient`;
    see the module docstring). ``dtype`` is the dtype the publisher sends. ``commit_checksum``:
    read SGLang's weight checksum at every commit into :attr:`last_checksum` (a hash of every
    weight, ~5–25 ms; off by default: :meth:`checksum` reads it on demand). ``flattened`` (default):
    hand each buffer over as SGLang's ``flattened_bucket`` (one IPC handle and event per buffer,
    the tensors rebuilt as views there); False: one tensor per name (an IPC event each), which
    made a 1.88 GB in-place publish 1–4.5 ms slower than SGLang's own single call on the H200
    (docs/benchmarks.md, 2026-12-01)."""

    unsynced_acks = True
    verifies_checksums = False

    def __init__(self, client: EngineClient | HTTPClient, *, spec: HFModelSpec, dtype: torch.dtype = torch.bfloat16,
                 commit_checksum: bool = False, flattened: bool = True):
        self.client, self.spec, self.dtype = client, spec, dtype
        self.commit_checksum, self.flattened = commit_checksum, flattened
        self._specs = hf_param_specs(spec, dtype=dtype)
        self._open: int | None = None
        self._committed: int | None = None  # the last version end_update stamped
        self._pending: Any = None  # the last load, sent by end_update
        self.last_checksum: str | None = None
        """SGLang's checksum read at the last commit (``commit_checksum``), else None."""
        self.residency = Residency({t: (self._tag_hook("release", t), self._tag_hook("resume", t)) for t in ENGINE_TAGS},
                                   owner=client.owner, allocator=client.allocator)

    # ----- starting ---------------------------------------------------------------------------
    @classmethod
    def launch(cls, *, spec: HFModelSpec, param_dtype: torch.dtype = torch.bfloat16, hide_megatron: bool = True,
               call_timeout_s: float | None = None, start_timeout_s: float | None = None,
               commit_checksum: bool = False, **engine_kwargs: Any) -> SGLangEngine:
        """An in-process ``sglang.Engine(**engine_kwargs)`` (``engine_kwargs`` may hold the engine's
        own ``dtype``; ``param_dtype`` is the dtype the publisher sends; ``call_timeout_s``: the
        deadline of each engine call; ``start_timeout_s``: of the start; see
        :meth:`~colocate.sglang_clients.EngineClient.launch`)."""
        return cls(EngineClient.launch(hide_megatron=hide_megatron, call_timeout_s=call_timeout_s,
                                       start_timeout_s=start_timeout_s, **engine_kwargs),
                   spec=spec, dtype=param_dtype, commit_checksum=commit_checksum)

    @classmethod
    def connect(cls, base_url: str, *, spec: HFModelSpec, dtype: torch.dtype = torch.bfloat16,
                timeout_s: float = 600.0, ipc: str = "cuda") -> SGLangEngine:
        """A running SGLang server at ``base_url`` (see :class:`~colocate.sglang_clients.HTTPClient`)."""
        return cls(HTTPClient(base_url, timeout_s=timeout_s, ipc=ipc), spec=spec, dtype=dtype)

    @classmethod
    def launch_server(cls, config: SGLangServerConfig | None = None, *, spec: HFModelSpec,
                      param_dtype: torch.dtype = torch.bfloat16, commit_checksum: bool = False,
                      **launch_args: Any) -> SGLangEngine:
        """Start ``sglang.launch_server`` as a guarded colocated worker of this process (it dies
        with its owner) and connect; :meth:`shutdown` stops it. ``config``
        (:class:`~colocate.config.SGLangServerConfig`): the server arguments and the role's
        environment (:func:`sglang_server_launch_args`); ``launch_args``:
        :meth:`~colocate.sglang_clients.HTTPClient.launch`'s, the server's arguments included,
        given alone or replacing the config's (``env`` is merged over the config's)."""
        if config is not None:
            base = sglang_server_launch_args(config)
            env = {**base.pop("env"), **(launch_args.pop("env", None) or {})}
            launch_args = {**base, **launch_args, "env": env}
        return cls(HTTPClient.launch(**launch_args), spec=spec, dtype=param_dtype, commit_checksum=commit_checksum)

    @property
    def has_bracket(self) -> bool:
        return self.client.has_bracket

    def checksum(self) -> str:
        """The engine's current weight checksum (SGLang's weight checker)."""
        return self.client.checksum()

    def tag_bytes(self) -> dict[str, int]:
        """Bytes the engine's weights, KV cache and CUDA graphs take while resident, by SGLang's
        own accounting (:func:`~colocate.sglang_clients.tag_bytes_of`): what a release of every
        tag should return."""
        return tag_bytes_of(self.client.server_info())

    def _tag_hook(self, op: str, tag: str):
        def run() -> int:
            free0 = self._free_bytes()
            self.client.memory_occupation(op, tag)
            return abs(self._free_bytes() - free0)
        return run

    def _free_bytes(self) -> int:
        if self.client.ipc != "cuda" or not torch.cuda.is_available():
            return 0
        torch.cuda.synchronize()
        return torch.cuda.mem_get_info()[0]

    # ----- receiver surface ----------------------------------------------------------------
    def capabilities(self) -> frozenset[str]:
        return frozenset({"cuda_ipc" if self.client.ipc == "cuda" else "shm"})

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)

    def weight_version(self) -> int | None:
        """The version the engine serves as an int (None: none valid, or not one of ours)."""
        try:
            return int(self.client.weight_version())
        except (TypeError, ValueError):
            return None

    def begin_update(self, version: int) -> None:
        self.residency.require("weights")
        if self.residency.is_busy:  # SGLang's post-load flush asserts in its scheduler when requests run
            raise BusyError(f"SGLang engine: update to {version} while this adapter is generating")
        if self.client.has_bracket:
            self.client.begin_weight_update()
        self._open, self._pending = version, None

    def load_bucket(self, entries: list[Entry], buffer: torch.Tensor) -> None:
        """Check and queue one hand-over; the previous one is sent now, the last by
        :meth:`end_update` (one call fewer per publish: the cache flush rides on it)."""
        if self._open is None:
            raise UpdateError("load without begin_update")
        if (self.client.ipc == "cuda") != buffer.is_cuda:
            kind = "CUDA" if self.client.ipc == "cuda" else "CPU (shared-memory)"
            raise UpdateError(f"this SGLang engine takes {kind} tensors only, got a buffer on {buffer.device}")
        check_params({e.name: (tuple(e.shape), e.dtype) for e in entries}, self._specs, require_all=False)
        if self.flattened:
            tied = self.spec.arch == "qwen3_moe" and self.spec.tie_embeddings  # as sglang_named_tensors
            extra = [dataclasses.replace(e, name="lm_head.weight") for e in entries
                     if tied and e.name == "model.embed_tokens.weight"]
            load = flattened_bucket(buffer, [*entries, *extra])
        else:
            load = sglang_named_tensors(list(unpack_bucket(buffer, entries).items()), self.spec)
        previous, self._pending = self._pending, load
        if previous is not None:
            self._send(previous, flush_cache=False)

    def _send(self, load: Any, *, flush_cache: bool) -> None:
        if isinstance(load, dict):
            self.client.update_weights_from_bucket(load, flush_cache=flush_cache)
        else:
            self.client.update_weights_from_tensor(load, flush_cache=flush_cache)

    def end_update(self, version: int, checksums: dict[str, int] | None = None) -> None:
        """Send the last load (with SGLang's cache flush when the KV pool is resident; a
        released pool comes back empty anyway), close the bracket, stamp ``version``. SGLang
        answers a tensor load after its copies ran (its scheduler drops the received tensors
        before answering, and torch synchronizes the receiving stream when a CUDA-IPC storage
        is freed), so the publisher may hand the trainer's memory back once this returns."""
        if self._open != version:
            raise UpdateError(f"end_update({version}) without a matching begin_update (open: {self._open})")
        flush = self.residency.is_resident("kv_cache")
        last, self._pending = self._pending, None
        if last is not None:
            self._send(last, flush_cache=flush and not self.client.has_bracket)
        if self.client.has_bracket:
            self.client.end_weight_update()
        if flush and (last is None or self.client.has_bracket):
            self.client.flush_cache()
        self.last_checksum = self.client.checksum() if self.commit_checksum else None
        self.client.set_weight_version(str(version))
        self._open, self._committed = None, version

    def abort_update(self, version: int) -> None:
        """Close the update to ``version``; the loads were in place, so whether it was open or
        already committed (a publisher that gave up waiting), no version is valid afterwards."""
        if self._open == version:
            self._open, self._pending = None, None
            try:
                if self.client.has_bracket:
                    self.client.end_weight_update()
            finally:
                self.client.set_weight_version(None)  # weights may be half-updated
        elif self._committed == version:
            self._committed = None
            self.client.set_weight_version(None)

    def restore_from_disk(self, model_path: str, *, version: int | None = None) -> None:
        """Reload weights from an HF checkpoint folder (on the server's file system for a server;
        SGLang rolls back a failed load)."""
        self.client.update_weights_from_disk(model_path, None if version is None else str(version))
        self._committed = None

    # ----- residency and rollout -----------------------------------------------------------
    def release_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        return self.residency.release(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        return self.residency.resume(tags)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16, temperature: float = 0.0,
                 return_logprob: bool = True, seed: int | None = None) -> list[dict]:
        """Token-in/token-out generation; returns SGLang's output dicts (``output_ids``,
        ``meta_info.output_token_logprobs``), one per prompt."""
        params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True}
        if seed is not None:
            params["sampling_seed"] = seed
        with self.residency.busy():
            return self.client.generate([[int(x) for x in p] for p in prompts], params, return_logprob=return_logprob)

    def prompt_logprobs(self, prompt: Sequence[int]) -> list[float]:
        """Log-probabilities SGLang assigns to tokens 1..T-1 of ``prompt`` (prefill, no sampling)."""
        with self.residency.busy():
            out = self.client.generate([[int(x) for x in prompt]], {"max_new_tokens": 1, "temperature": 0.0},
                                       return_logprob=True, logprob_start_len=0)
        return logprobs_of_prompt(out[0]["meta_info"]["input_token_logprobs"], prompt)

    def shutdown(self) -> None:
        """Shut the engine down (a launched server: its worker's whole process group)."""
        self.client.shutdown()
