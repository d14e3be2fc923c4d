"""Rollout engines behind one protocol; the embedded ``transformers`` engine.

The protocols (:class:`~colocate.protocol.WeightReceiver`, :class:`~colocate.protocol.RolloutEngine`)
live in :mod:`colocate.protocol`. :class:`HFEngine` is a real receiver and sampler on a ``transformers`` Qwen3 / Qwen3-MoE model
built from an :class:`~colocate.config.HFModelSpec` (CPU or GPU). Commit swaps parameter
storage with a staged shadow copy (so the shadow doubles the engine's weight memory) and a
failed post-commit check can swap back. The SGLang adapter lives in
:mod:`colocate.sglang_engine` (imports ``sglang`` lazily).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from colocate.buckets import Entry, tensor_checksum, unpack_bucket
from colocate.config import EngineConfig, HFModelSpec
from colocate.convert import check_params, hf_param_specs
from colocate.errors import (
    ControlTimeoutError,
    EngineDestroyedError,
    GenerationAbortedError,
    NotResidentError,
    UpdateError,
)
from colocate.protocol import RolloutEngine, WeightReceiver
from colocate.residency import ENGINE_TAGS, Residency, TensorOffload

__all__ = ["WeightReceiver", "RolloutEngine", "UpdateError", "HFEngine", "GenerateResult", "hf_config",
           "build_hf_model", "hf_checkpoint_views", "ControlTimeoutError", "GenerationAbortedError",
           "EngineDestroyedError", "AsyncEngine", "off_loop"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(spec: HFModelSpec, *, dtype: torch.dtype = torch.float32):
    """A ``transformers`` Qwen3Config / Qwen3MoeConfig with ``spec``'s shapes."""
    common = dict(vocab_size=spec.serve_vocab_size or spec.vocab_size, hidden_size=spec.hidden_size, num_hidden_layers=spec.num_layers,
                  num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_query_groups,
                  head_dim=spec.head_dim, intermediate_size=spec.ffn_hidden_size, rms_norm_eps=spec.rms_norm_eps,
                  max_position_embeddings=spec.max_position_embeddings, tie_word_embeddings=spec.tie_embeddings,
                  rope_theta=spec.rope_theta,  # the legacy keyword: transformers 5.x maps it to rope_parameters
                  attention_bias=False, hidden_act="silu", dtype=dtype)
    if spec.arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common)
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**common, num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                          moe_intermediate_size=spec.moe_ffn_hidden_size, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)


def build_hf_model(spec: HFModelSpec, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """A randomly initialised ``transformers`` causal LM for ``spec`` in eval mode."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(spec, dtype=dtype)
    cfg._attn_implementation = "eager"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def hf_checkpoint_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF checkpoint name → writable view into ``model``'s parameters.

    transformers ≥ 5 stores MoE experts fused (``experts.gate_up_proj`` [E, 2F, H],
    ``experts.down_proj`` [E, H, F]); checkpoint names ``experts.{e}.gate_proj.weight`` etc. map
    to slices of them. Tied ``lm_head.weight`` is absent (it aliases the embedding).
    """
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre, F = name[: -len("gate_up_proj")], p.shape[1] // 2
            for e in range(p.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = p.data[e, :F]
                out[f"{pre}{e}.up_proj.weight"] = p.data[e, F:]
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e in range(p.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = p.data[e]
        else:
            out[name] = p.data
    return out


@dataclass
class GenerateResult:
    """``tokens[i]``: generated ids of prompt i; ``logprobs[i]``: log-probability of each under
    the distribution it was sampled from (``log_softmax(logits / T)``; T = 1 when greedy)."""

    tokens: list[list[int]]
    logprobs: list[list[float]]


class HFEngine:
    """Embedded rollout engine on a ``transformers`` model, with residency and versioned updates.

    Residency tags ``kv_cache``, ``weights``, ``cuda_graph``. The engine keeps no KV pool or CUDA
    graphs between calls, so those two release 0 bytes; ``weights`` frees parameter storage and
    its contents (as SGLang does without a CPU backup) and the staging shadow: generation is
    refused until a publish after resume.

    Versions: a commit keeps the previous weights (and their version) in the shadow until the next
    ``begin_update``; :meth:`rollback`, or an ``abort_update`` of the version just committed,
    swaps them back, and :meth:`weight_version` then reports the version served again.
    """

    def __init__(self, spec: HFModelSpec, config: EngineConfig | None = None):
        self.spec = spec
        self.config = config or EngineConfig()
        self.dtype = _DTYPES[self.config.dtype]
        self.device = torch.device(self.config.device)
        self.model = build_hf_model(spec, dtype=self.dtype, device=self.device)
        self._views = hf_checkpoint_views(self.model)
        self._specs = {n: (tuple(v.shape), v.dtype) for n, v in self._views.items()}
        expected = hf_param_specs(spec, dtype=self.dtype)
        check_params(self._specs, expected)
        self._params = [p for p in self.model.parameters()]
        self._shadow: list[torch.Tensor] | None = None
        self._shadow_views: dict[str, torch.Tensor] | None = None
        self._pending: tuple[int, set[str]] | None = None
        self._version: int | None = None
        self._previous: tuple[int | None] | None = None  # (version in the shadow,) while a rollback is possible
        self._valid = True
        self._lock = threading.RLock()
        # control plane: flags are set without the lock; generation checks them between decode steps
        self._cond = threading.Condition(self._lock)
        self._pause = threading.Event()
        self._abort_epoch = 0
        self._destroyed = False
        self._freed = False
        self.tokens_generated = 0
        """Decode steps run by this engine (all rows of one step count 1); progress for monitors."""
        weights = TensorOffload(lambda: self._params, keep_contents=False)

        def release_weights() -> int:
            self._valid = False
            shadow = sum(t.untyped_storage().nbytes() for t in self._shadow or [])
            self._shadow = self._shadow_views = self._previous = None  # the staging copy goes too: no rollback
            return weights.release() + shadow

        self.residency = Residency({"kv_cache": (lambda: 0, lambda: 0), "weights": (release_weights, weights.resume),
                                    "cuda_graph": (lambda: 0, lambda: 0)}, owner="hf_engine")
        assert self.residency.tags == ENGINE_TAGS

    # ----- receiver surface -------------------------------------------------------------
    def capabilities(self) -> frozenset[str]:
        caps = {"inprocess", "shm", "disk"}
        if self.device.type == "cuda":
            caps.add("cuda_ipc")
        return frozenset(caps)

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return dict(self._specs)

    def weight_version(self) -> int | None:
        """The version served; None before the first commit, and from a release of ``weights``
        (their contents are gone) until the next commit."""
        return self._version if self._valid else None

    def resident_bytes(self) -> int:
        """Bytes of the storages the engine holds now: its parameters and the staging copy (each
        storage once; a released tag's storages are resized to 0)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in [*self._params, *(self._shadow or [])]}
        return sum(storages.values())

    def release_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        with self._lock:
            return self.residency.release(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        with self._lock:
            return self.residency.resume(tags)

    def begin_update(self, version: int) -> None:
        with self._lock:
            self._alive()
            self.residency.require("weights")
            if self._pending is not None:
                if version <= self._pending[0]:
                    raise UpdateError(f"begin_update({version}): update {self._pending[0]} still open")
                self._pending = None  # a newer update supersedes an abandoned one (never committed)
            if self._shadow is None:
                self._shadow = [torch.empty_like(p) for p in self._params]
                self._shadow_views = self._views_of(self._shadow)
            self._previous = None  # the shadow is overwritten: no rollback past this point
            for s, p in zip(self._shadow, self._params):
                s.copy_(p.data)
            self._pending = (version, set())

    def _views_of(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        saved = [p.data for p in self._params]
        try:
            for p, t in zip(self._params, tensors):
                p.data = t
            return hf_checkpoint_views(self.model)
        finally:
            for p, t in zip(self._params, saved):
                p.data = t

    def load_tensors(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stage tensors (HF names) into the open update; checked against :meth:`param_specs`."""
        with self._lock:
            if self._pending is None:
                raise UpdateError("load without begin_update")
            named = list(named)
            check_params({n: (tuple(t.shape), t.dtype) for n, t in named}, self._specs, require_all=False)
            for n, t in named:
                self._shadow_views[n].copy_(t, non_blocking=True)
                self._pending[1].add(n)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()

    def load_bucket(self, entries: list[Entry], buffer: torch.Tensor) -> None:
        self.load_tensors(unpack_bucket(buffer, entries).items())

    def end_update(self, version: int, checksums: dict[str, int] | None = None) -> None:
        """Verify the staged tensors against ``checksums`` (if given), then commit by swapping
        storage; raise :class:`UpdateError` (nothing applied) on any mismatch."""
        with self._lock:
            if self._pending is None or self._pending[0] != version:
                raise UpdateError(f"end_update({version}) without a matching begin_update (open: {self._pending})")
            if checksums is not None:
                missing = sorted(set(checksums) - self._pending[1])
                bad = [n for n, c in checksums.items() if n in self._pending[1]
                       and tensor_checksum(self._shadow_views[n]) != c]
                if missing or bad:
                    self.abort_update(version)
                    raise UpdateError(f"update {version}: {len(bad)} checksum mismatch(es) {bad[:10]}, "
                                      f"{len(missing)} tensor(s) never received {missing[:10]}")
            self._swap()  # the shadow now holds the previous weights
            self._previous = (self._version,) if self._valid else None  # released weights: nothing to go back to
            self._version = version
            self._valid = True
            self._pending = None

    def _swap(self) -> None:
        for p, s in zip(self._params, self._shadow):
            p.data, s.data = s.data, p.data
        self._shadow_views = self._views_of(self._shadow)

    def rollback(self) -> None:
        """Swap back to the weights before the last commit (once; valid until the next
        ``begin_update``); :meth:`weight_version` reports their version again."""
        with self._lock:
            if self._previous is None or self._pending is not None:
                raise UpdateError("rollback: nothing committed to roll back")
            self._swap()
            (self._version,), self._previous = self._previous, None

    def abort_update(self, version: int) -> None:
        """Drop the open update to ``version``; if ``version`` was committed already (a publisher
        that timed out waiting for ``end_update`` aborts after the commit), roll back to the
        previous weights, or serve none when they are gone: a poisoned version is never served."""
        with self._lock:
            if self._pending is not None and self._pending[0] == version:
                self._pending = None
            elif self._version == version:
                if self._previous is not None:
                    self.rollback()
                else:
                    self._version, self._valid = None, False

    def checksums(self, names: Iterable[str] | None = None) -> dict[str, int]:
        with self._lock:
            views = hf_checkpoint_views(self.model)
            return {n: tensor_checksum(views[n]) for n in (names if names is not None else views)}

    def sample(self, indices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Live values at flat ``indices`` per HF name (for sampled verification)."""
        with self._lock:
            views = hf_checkpoint_views(self.model)
            return {n: views[n].reshape(-1)[i.to(self.device)].cpu().clone() for n, i in indices.items()}

    def read(self, name: str) -> torch.Tensor:
        """A copy of one live parameter by HF checkpoint name."""
        return hf_checkpoint_views(self.model)[name].detach().clone()

    # ----- inference ----------------------------------------------------------------------
    def _alive(self) -> None:
        if self._destroyed:
            raise EngineDestroyedError("hf_engine: destroyed; build a new engine")

    def _ready(self) -> None:
        self._alive()
        self.residency.require(*ENGINE_TAGS)
        if not self._valid:
            raise NotResidentError("hf_engine: weights were released and not re-published since")

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-sequence logits [B, T, V] (fp32) for ``input_ids`` [B, T] without padding."""
        with self._lock, self.residency.busy():
            self._ready()
            out = self.model(input_ids=input_ids.to(self.device), use_cache=False)
            return out.logits.float()

    # ----- control plane --------------------------------------------------------------------
    def _acquire(self, op: str, deadline: float, timeout: float) -> None:
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise ControlTimeoutError(op, timeout, "the engine is inside one forward or a weight update longer "
                                      "than that; lower generate(chunk_rows=...) to shorten the longest step")

    def pause(self, *, timeout: float = 30.0) -> None:
        """Stop generation at the next decode step (in place: KV cache and sampled tokens kept) and
        return once the engine is quiescent. New ``generate`` calls wait at their first step. While
        paused, weight updates and :meth:`abort` / :meth:`destroy` proceed; :meth:`resume` continues
        (tokens sampled after it use the weights then current). Raises :class:`ControlTimeoutError`;
        the pause then stays requested (generation parks when it reaches a step) until :meth:`resume`."""
        deadline = time.monotonic() + timeout
        self._pause.set()
        self._acquire("pause", deadline, timeout)  # held by a generation only between checkpoints
        self._lock.release()

    def resume(self) -> None:
        """Undo :meth:`pause`; parked generations continue."""
        self._pause.clear()
        # Parked generations also re-check every 0.5 s; waking them needs the lock, which a running
        # (never parked) generation holds until it ends, so do not block on it here.
        if self._lock.acquire(blocking=False):
            try:
                self._cond.notify_all()
            finally:
                self._lock.release()

    @property
    def paused(self) -> bool:
        return self._pause.is_set()

    def abort(self, *, timeout: float = 30.0) -> None:
        """Make every in-flight ``generate`` raise :class:`GenerationAbortedError` (with its partial
        result) at its next decode step (parked ones are woken), and return once they have let go of
        the engine. Calls started after it are not affected; the pause state is unchanged. Raises
        :class:`ControlTimeoutError`."""
        deadline = time.monotonic() + timeout
        self._abort_epoch += 1
        self._acquire("abort", deadline, timeout)
        try:
            self._cond.notify_all()  # wake parked generations so they see the abort
        finally:
            self._lock.release()
        self._acquire("abort", deadline, timeout)  # they have raised and let go of the lock
        self._lock.release()

    def destroy(self, *, timeout: float = 30.0) -> None:
        """Abort in-flight generation (bounded by ``timeout``), then free the weights and the staging
        shadow. Later calls raise :class:`EngineDestroyedError` (from the moment it is called). On
        :class:`ControlTimeoutError` the weights are not freed yet; call it again. Idempotent."""
        if self._freed:
            return
        deadline = time.monotonic() + timeout
        self._destroyed = True  # refuses new work at once; a timed-out destroy can be retried
        try:
            self.abort(timeout=max(0.0, deadline - time.monotonic()))
        except ControlTimeoutError as exc:
            raise ControlTimeoutError("destroy", timeout, str(exc)) from exc
        self._acquire("destroy", deadline, timeout)
        try:
            for p in self._params:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            self._shadow = self._shadow_views = None
            self._views = {}
            self._pending = None
            self._pause.clear()
            self._freed = True
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        finally:
            self._lock.release()

    def _checkpoint(self, epoch: int, partial: Callable[[], GenerateResult]) -> None:
        """Between decode steps (lock held): park while paused, raise on abort / destroy."""
        while True:
            if self._abort_epoch != epoch or self._destroyed:
                raise GenerationAbortedError(
                    f"hf_engine: generation {'destroyed' if self._destroyed else 'aborted'} after "
                    f"{sum(map(len, partial().tokens))} sampled tokens", partial())
            if not self._pause.is_set():
                return
            self._cond.wait(timeout=0.5)  # releases the lock while parked

    # ----- inference ----------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, seed: int = 0,
                 eos_token_id: int | None = None, chunk_rows: int | None = None) -> GenerateResult:
        """Batched sampling with per-token logprobs. Prompts are left-padded; each sequence
        samples from its own generator seeded ``seed + i``, so a sequence's tokens do not
        depend on the other prompts' sampling (nor on ``chunk_rows``). ``temperature=0`` is greedy.

        ``chunk_rows`` runs the prompts in row chunks of that size, one after another: the longest
        uninterruptible step (one forward) is then that of ``chunk_rows`` rows. Between decode steps
        the engine honours :meth:`pause` (parks), :meth:`abort` and :meth:`destroy` (raise
        :class:`GenerationAbortedError` carrying the partial result)."""
        n_new = max_new_tokens or self.config.max_new_tokens
        temp = self.config.temperature if temperature is None else temperature
        k = self.config.top_k if top_k is None else top_k
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError(f"generate: every prompt needs >= 1 token, got lengths {[len(p) for p in prompts]}")
        if temp < 0:
            raise ValueError(f"generate: temperature must be >= 0, got {temp}")
        if chunk_rows is not None and chunk_rows < 1:
            raise ValueError(f"generate: chunk_rows must be >= 1 or None, got {chunk_rows}")
        self._alive()
        epoch = self._abort_epoch
        B = len(prompts)
        step = chunk_rows or B
        tokens: list[list[int]] = [[] for _ in range(B)]
        logps: list[list[float]] = [[] for _ in range(B)]
        partial = lambda: GenerateResult([list(t) for t in tokens], [list(x) for x in logps])  # noqa: E731
        with self._lock, self.residency.busy():
            for lo in range(0, B, step):
                hi = min(B, lo + step)
                self._checkpoint(epoch, partial)
                self._ready()
                self._generate_rows(prompts[lo:hi], tokens[lo:hi], logps[lo:hi], n_new=n_new, temp=temp, k=k,
                                    seed=seed + lo, eos_token_id=eos_token_id, epoch=epoch, partial=partial)
            return GenerateResult(tokens, logps)

    def _generate_rows(self, prompts, tokens, logps, *, n_new, temp, k, seed, eos_token_id, epoch, partial) -> None:
        """Sample rows ``prompts`` into ``tokens`` / ``logps`` (lists, filled in place)."""
        B, L = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(B, L, dtype=torch.long, device=self.device)
        mask = torch.zeros(B, L, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(list(p), device=self.device)
            mask[i, L - len(p):] = 1
        gens = [torch.Generator(device=self.device).manual_seed(seed + i) for i in range(B)]
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        done = torch.zeros(B, dtype=torch.bool, device=self.device)
        step_ids = ids
        for t in range(n_new):
            if t:
                self._checkpoint(epoch, partial)
                self._ready()  # weights may have been released while parked
            pos = (mask.cumsum(-1) - 1).clamp_min(0)[:, -step_ids.shape[1]:]
            out = self.model(input_ids=step_ids, attention_mask=mask, position_ids=pos,
                             past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1].float()
            if temp == 0:
                lp = torch.log_softmax(logits, -1)
                nxt = lp.argmax(-1)
            else:
                scaled = logits / temp
                if k > 0:
                    kth = scaled.topk(min(k, scaled.shape[-1]), -1).values[:, -1:]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                lp = torch.log_softmax(scaled, -1)
                probs = lp.exp()
                nxt = torch.stack([torch.multinomial(probs[i], 1, generator=gens[i])[0] for i in range(B)])
            for i in range(B):
                if not done[i]:
                    tokens[i].append(int(nxt[i]))
                    logps[i].append(float(lp[i, nxt[i]]))
            self.tokens_generated += 1
            if eos_token_id is not None:
                done |= nxt == eos_token_id
                if bool(done.all()):
                    break
            step_ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=self.device)], dim=1)


async def off_loop(fn: Callable, /, *args, executor: Executor | None = None, **kwargs):
    """Run blocking ``fn(*args, **kwargs)`` (tokenization, serialization, a generate call) in
    ``executor`` (default: the loop's thread pool) so the event loop keeps serving requests."""
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, **kwargs))


class AsyncEngine:
    """asyncio front of an :class:`HFEngine` for a control-plane server: every blocking call (batch
    tokenization, serialization, generation, pause / abort / destroy waits) runs off the event loop.

    ``tokenizer`` needs ``encode(text, add_special_tokens=False) -> list[int]`` (transformers
    tokenizers do)."""

    def __init__(self, engine: HFEngine, *, tokenizer=None, executor: Executor | None = None):
        self.engine, self.tokenizer, self.executor = engine, tokenizer, executor

    def _encode_all(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of every text, computed in the executor."""
        if self.tokenizer is None:
            raise ValueError("AsyncEngine.encode: no tokenizer was given")
        return await off_loop(self._encode_all, list(texts), executor=self.executor)

    async def serialize(self, obj) -> bytes:
        """``torch.save`` bytes of ``obj`` (e.g. a :class:`GenerateResult`), computed in the executor."""
        import io

        def dump():
            buf = io.BytesIO()
            torch.save(obj, buf)
            return buf.getvalue()

        return await off_loop(dump, executor=self.executor)

    async def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> GenerateResult:
        return await off_loop(self.engine.generate, prompts, executor=self.executor, **kwargs)

    async def pause(self, *, timeout: float = 30.0) -> None:
        await off_loop(self.engine.pause, timeout=timeout, executor=self.executor)

    async def resume(self) -> None:
        await off_loop(self.engine.resume, executor=self.executor)

    async def abort(self, *, timeout: float = 30.0) -> None:
        await off_loop(self.engine.abort, timeout=timeout, executor=self.executor)

    async def destroy(self, *, timeout: float = 30.0) -> None:
        await off_loop(self.engine.destroy, timeout=timeout, executor=self.executor)
