"""Rollout engines behind one protocol; the embedded ``transformers`` engine.

:class:`WeightReceiver` is what the publisher talks to: it names the parameters it expects,
stages a versioned update (``begin_update`` → ``load_bucket``… → ``end_update``), verifies,
then commits atomically, or drops it (``abort_update``) and keeps the previous weights.

:class:`HFEngine` is a real receiver and sampler on a ``transformers`` Qwen3 / Qwen3-MoE model
built from an :class:`~colocate.config.HFModelSpec` (CPU or GPU). Commit swaps parameter
storage with a staged shadow copy (so the shadow doubles the engine's weight memory) and a
failed post-commit check can swap back. The SGLang adapter lives in
:mod:`colocate.sglang_engine` (imports ``sglang`` lazily).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from colocate.buckets import Entry, tensor_checksum, unpack_bucket
from colocate.config import EngineConfig, HFModelSpec
from colocate.convert import check_params, hf_param_specs
from colocate.residency import ENGINE_TAGS, NotResidentError, Residency, TensorOffload

__all__ = ["WeightReceiver", "UpdateError", "HFEngine", "GenerateResult", "hf_config", "build_hf_model",
           "hf_checkpoint_views"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UpdateError(RuntimeError):
    """A weight update was refused or failed on the receiver; the previous weights stay."""


@runtime_checkable
class WeightReceiver(Protocol):
    """The receiving side of a publish (an engine, or a proxy to one in another process)."""

    def capabilities(self) -> frozenset[str]:
        """Transports it accepts: subset of ``{"inprocess", "shm", "cuda_ipc", "disk"}``."""

    def param_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """HF name → (shape, dtype) of every parameter it holds."""

    def begin_update(self, version: int) -> None: ...

    def load_bucket(self, entries: list[Entry], buffer: torch.Tensor) -> None: ...

    def end_update(self, version: int, checksums: dict[str, int] | None) -> None: ...

    def abort_update(self, version: int) -> None: ...

    def weight_version(self) -> int | None: ...

    def checksums(self, names: Iterable[str] | None = None) -> dict[str, int]: ...


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
        self._valid = True
        self._lock = threading.RLock()
        weights = TensorOffload(lambda: self._params, keep_contents=False)

        def release_weights() -> int:
            self._valid = False
            shadow = sum(t.untyped_storage().nbytes() for t in self._shadow or [])
            self._shadow = self._shadow_views = None  # the staging copy goes too (no rollback after)
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
        return self._version

    def release_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        with self._lock:
            return self.residency.release(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> dict[str, int]:
        with self._lock:
            return self.residency.resume(tags)

    def begin_update(self, version: int) -> None:
        with self._lock:
            self.residency.require("weights")
            if self._pending is not None:
                if version <= self._pending[0]:
                    raise UpdateError(f"begin_update({version}): update {self._pending[0]} still open")
                self._pending = None  # a newer update supersedes an abandoned one (never committed)
            if self._shadow is None:
                self._shadow = [torch.empty_like(p) for p in self._params]
                self._shadow_views = self._views_of(self._shadow)
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
            for p, s in zip(self._params, self._shadow):
                p.data, s.data = s.data, p.data
            # the shadow now holds the previous weights: re-point its views
            self._shadow_views = self._views_of(self._shadow)
            self._version = version
            self._valid = True
            self._pending = None

    def rollback(self) -> None:
        """Swap back to the weights before the last commit (valid until the next begin_update)."""
        with self._lock:
            if self._shadow is None or self._pending is not None:
                raise UpdateError("rollback: nothing committed to roll back")
            for p, s in zip(self._params, self._shadow):
                p.data, s.data = s.data, p.data
            self._shadow_views = self._views_of(self._shadow)
            self._version = None

    def abort_update(self, version: int) -> None:
        with self._lock:
            if self._pending is not None and self._pending[0] == version:
                self._pending = None

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
    def _ready(self) -> None:
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

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | None = None,
                 temperature: float | None = None, top_k: int | None = None, seed: int = 0,
                 eos_token_id: int | None = None) -> GenerateResult:
        """Batched sampling with per-token logprobs. Prompts are left-padded; each sequence
        samples from its own generator seeded ``seed + i``, so a sequence's tokens do not
        depend on the other prompts' sampling. ``temperature=0`` is greedy."""
        n_new = max_new_tokens or self.config.max_new_tokens
        temp = self.config.temperature if temperature is None else temperature
        k = self.config.top_k if top_k is None else top_k
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError(f"generate: every prompt needs >= 1 token, got lengths {[len(p) for p in prompts]}")
        if temp < 0:
            raise ValueError(f"generate: temperature must be >= 0, got {temp}")
        with self._lock, self.residency.busy():
            self._ready()
            B, L = len(prompts), max(len(p) for p in prompts)
            ids = torch.zeros(B, L, dtype=torch.long, device=self.device)
            mask = torch.zeros(B, L, dtype=torch.long, device=self.device)
            for i, p in enumerate(prompts):
                ids[i, L - len(p):] = torch.tensor(list(p), device=self.device)
                mask[i, L - len(p):] = 1
            gens = [torch.Generator(device=self.device).manual_seed(seed + i) for i in range(B)]
            from transformers import DynamicCache

            cache = DynamicCache(config=self.model.config)
            tokens: list[list[int]] = [[] for _ in range(B)]
            logps: list[list[float]] = [[] for _ in range(B)]
            done = torch.zeros(B, dtype=torch.bool, device=self.device)
            step_ids = ids
            for _ in range(n_new):
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
                if eos_token_id is not None:
                    done |= nxt == eos_token_id
                    if bool(done.all()):
                        break
                step_ids = nxt[:, None]
                mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=self.device)], dim=1)
            return GenerateResult(tokens, logps)

