"""The rollout engine, chosen by ``engine.kind``, behind the few calls the runner makes.

``hf``: the embedded :class:`colocate.HFEngine` (CPU, CI). ``sglang``: an in-process
``sglang.Engine`` through :meth:`colocate.SGLangEngine.launch`, loading the student's Hugging Face
folder (GPU). Both are :class:`colocate.RolloutEngine` receivers with ``kv_cache`` / ``weights``
/ ``cuda_graph`` residency, so :class:`colocate.ColocatedCycle` and :class:`colocate.Publisher`
drive them the same way; only generation's return type differs, which :func:`sample` hides.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch

from examples.demo.config import DemoConfig
from examples.demo.errors import EngineStartError

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def publish_dtype(cfg: DemoConfig) -> torch.dtype:
    """The dtype the publisher sends (the engine's)."""
    return _DTYPES[cfg.engine.dtype]


def build_engine(cfg: DemoConfig, spec, hf_dir: str | None, device: torch.device):
    """Start the engine of ``cfg.engine.kind`` for ``spec``; any failure is :class:`EngineStartError`.
    ``hf_dir``: the student's Hugging Face folder (what SGLang loads; the HF engine starts empty
    and gets its weights from the first publish)."""
    try:
        _check_folder(hf_dir, spec)
        if cfg.engine.kind == "hf":
            from colocate import EngineConfig, HFEngine

            engine = HFEngine(spec, EngineConfig(max_new_tokens=cfg.length, temperature=cfg.mopd.temperature,
                                                 dtype=cfg.engine.dtype, device=str(device)))
            engine.logits(torch.zeros(1, 1, dtype=torch.long))  # start probe: one forward on its device
            return engine
        from colocate import SGLangEngine

        os.environ.update(cfg.engine.env)  # read by SGLang's processes at start (e.g. the memory saver's)
        args = sglang_args(cfg, hf_dir, device)
        free0 = torch.cuda.mem_get_info(device)[0]
        t0 = time.monotonic()
        _rank0_warning("sglang engine on %s (cuda:%s): starting (engine.start_timeout_s=%s)", hf_dir, args["base_gpu_id"],
                       cfg.engine.start_timeout_s)
        engine = SGLangEngine.launch(spec=spec, param_dtype=publish_dtype(cfg), start_timeout_s=cfg.engine.start_timeout_s,
                                     **args)
        _rank0_warning("sglang engine: started in %.1fs", time.monotonic() - t0)
        torch.cuda.synchronize(device)
        # what "resident fraction" divides by: the bytes of weights + KV + graphs by SGLang's own
        # accounting; and the device memory the whole start took (its CUDA context included,
        # which only the process's exit returns; nothing else allocates meanwhile)
        engine.held_bytes = engine.tag_bytes()
        engine.footprint_bytes = max(0, free0 - torch.cuda.mem_get_info(device)[0])
        return engine
    except Exception as e:  # noqa: BLE001 - every start failure is one typed error naming the engine
        raise EngineStartError(f"engine.kind={cfg.engine.kind!r} failed to start: {type(e).__name__}: {e}") from e


def _rank0_warning(msg: str, *args) -> None:
    """A start-up line on rank 0 (the demo shows WARNING and above)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        log.warning(msg, *args)


def sglang_args(cfg: DemoConfig, hf_dir: str, device: torch.device) -> dict:
    """``sglang.Engine`` arguments of ``engine.*`` (:func:`colocate.sglang_engine.sglang_engine_args`:
    Triton attention, PyTorch sampling, no grammar backend, no tokenizer, the memory saver on)."""
    from colocate.sglang_engine import sglang_engine_args

    return sglang_engine_args(hf_dir, cuda_graph=cfg.engine.cuda_graph, memory_saver=True,
                              mem_fraction_static=cfg.engine.mem_fraction_static,
                              max_total_tokens=cfg.engine.max_total_tokens, dtype=cfg.engine.dtype,
                              random_seed=cfg.seed, base_gpu_id=device.index or 0)


def _check_folder(hf_dir: str | None, spec) -> None:
    """The engine's model folder holds this student (``config.json`` widths and vocabulary)."""
    import json
    from pathlib import Path

    cfg_file = Path(str(hf_dir)) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no Hugging Face config at {cfg_file}")
    c = json.loads(cfg_file.read_text())
    want = {"hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers, "vocab_size": spec.vocab_size}
    bad = {k: (c.get(k), v) for k, v in want.items() if c.get(k) != v}
    if bad:
        raise ValueError(f"{cfg_file} does not describe the student: (folder, student) = {bad}")


def sample(engine, prompts: Sequence[Sequence[int]], *, n_new: int, temperature: float,
           seed: int) -> tuple[list[list[int]], list[list[float]]]:
    """Generated ids and their behaviour log-probs (log softmax(z / τ) of each sampled token)."""
    # the HF engine seeds row i with seed + i; SGLang's engine samples with its own generator
    # (``random_seed`` at start): its per-request seed parameter differs across releases
    kw = {"seed": seed} if getattr(engine, "client", None) is None else {}
    out = engine.generate([list(p) for p in prompts], max_new_tokens=n_new, temperature=temperature, **kw)
    if hasattr(out, "tokens"):  # HFEngine's GenerateResult
        return out.tokens, out.logprobs
    tokens = [list(o["output_ids"])[:n_new] for o in out]  # SGLang output dicts
    logps = [[float(e[0]) for e in o["meta_info"]["output_token_logprobs"]][:n_new] for o in out]
    return tokens, logps


def greedy(engine, prompts: Sequence[Sequence[int]], *, n_new: int) -> torch.Tensor:
    """Greedy continuations ``[N, n_new]`` of ``prompts`` by the engine (its served weights)."""
    tokens, _ = sample(engine, prompts, n_new=n_new, temperature=0.0, seed=0)
    return torch.tensor(tokens)


def resident_bytes(engine) -> int | None:
    """Bytes the HF engine's tensors hold now (:meth:`colocate.HFEngine.resident_bytes`); None for
    SGLang (measured from the device's free memory instead, see
    :func:`examples.demo.runner.engine_resident_fraction`)."""
    return engine.resident_bytes() if hasattr(engine, "resident_bytes") else None


def shutdown(engine) -> None:
    """Stop the engine (SGLang: its scheduler processes; HF: free its weights)."""
    if engine is None:
        return
    if hasattr(engine, "shutdown"):
        engine.shutdown()
    elif hasattr(engine, "destroy"):
        engine.destroy()
