"""Fault injection for the Megatron checkpoint path: a 1-rank gloo training process that saves a
checkpoint and SIGKILLs itself at a chosen point of the save (``python -m`` entry point), used by
``test_checkpoint_megatron.py``.

Kill points are the calls, during one save, of every operation that makes the save durable or
visible: each file write of ``dist_checkpointing`` (``_write_item``), ``os.fsync``,
``os.replace``, ``os.rename``, ``os.mkdir``, ``shutil.rmtree`` and the directory exchange
(``mcore_distill.atomic._exchange``). The child is killed *before* the chosen call runs.

Commands (``python -m tests.optim_staged.ckpt_faults CMD WORK ...``):

* ``prepare WORK``: train 1 step, save A into ``WORK/ckpts/ckpt``, record A's state in
  ``WORK/A.pt``; train 1 more step, record ``WORK/B.pt``; save B once elsewhere with every
  kill point recorded in ``WORK/points.json``.
* ``kill WORK K STATE``: load ``WORK/ckpts/ckpt``, record which state it holds in
  ``WORK/loaded-K.json``; then train to STATE (A or B) and save it over the checkpoint, dying at
  kill point K.
* ``async-kill WORK``: save A, train to B, start :func:`async_save_checkpoint` of B with a slowed
  writer, take a step, and die while the writer is in the middle of its files.
* ``helpers WORK``: save once, write the pids of this process's ``multiprocessing`` children (the
  write-results queue's manager) to ``WORK/helpers.json`` and wait to be killed.
* ``verify WORK``: load the checkpoint, record which state it holds (``loaded-final.json``), save
  it again (no fault) and list what is left next to it.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch

S, B = 16, 2


def _init() -> None:
    from mcore_distill import cpu_compat
    from mcore_distill.testing import free_port, init_megatron

    torch.set_num_threads(1)
    cpu_compat.enable()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    init_megatron(tp=1, pp=1, seed=7)


def build(seed: int = 7):
    """A tiny bf16 GPT under Megatron DDP with the staged AdamW distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    from mcore_distill.testing import TinyGPTConfig, build_tiny_gpt, seed_all
    from optim_staged.config import AdamWConfig, SlotConfig, StagedOptimizerConfig
    from optim_staged.megatron import get_staged_optimizer

    seed_all(seed)
    model = build_tiny_gpt(TinyGPTConfig(num_layers=1, params_dtype=torch.bfloat16))
    model = Float16Module(model.config, model)
    model = DDP(model.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True),
                model)
    model.config.finalize_model_grads_func = finalize_model_grads
    cfg = StagedOptimizerConfig(adamw=AdamWConfig(lr=2e-3, weight_decay=0.1, impl="foreach"),
                                slots=SlotConfig(slot_numel=4096, num_slots=2))
    return model, get_staged_optimizer(cfg, [model])


def train(model, optim, steps: range) -> None:
    from megatron.core.pipeline_parallel import get_forward_backward_func

    device = next(model.parameters()).device
    for step in steps:
        tokens = torch.randint(0, 128, (B, S), generator=torch.Generator().manual_seed(step)).to(device)

        def fwd(it, m, tokens=tokens):
            out = m(tokens, torch.arange(S, device=device).expand(B, S), None, labels=tokens)
            return out, lambda o: (o.float().mean(), {})

        model.zero_grad_buffer()
        optim.zero_grad()
        get_forward_backward_func()(forward_step_func=fwd, data_iterator=iter([None]), model=[model],
                                    num_microbatches=1, seq_length=S, micro_batch_size=B, forward_only=False)
        ok, _, _ = optim.step()
        assert ok


def fingerprint(model, optim) -> dict[str, torch.Tensor]:
    """Model parameters and every staged state tensor (host slabs) with the step counters."""
    out = {f"model.{n}": p.detach().float().cpu().clone() for n, p in model.named_parameters()}
    for i, inner in enumerate(staged_inners(optim)):
        inner.drain(release=False)
        for k, t in inner.slabs.tensors.items():
            out[f"leaf{i}.{k}"] = t.clone()
        out[f"leaf{i}.steps"] = torch.tensor([g["step"] for g in inner.param_groups])
    return out


def staged_inners(optim) -> list:
    """The staged optimizers inside a (nested) Megatron optimizer chain, in chain order."""
    from optim_staged.base import StagedOptimizerBase

    if isinstance(optim, StagedOptimizerBase):
        return [optim]
    if hasattr(optim, "chained_optimizers"):
        return [x for leaf in optim.chained_optimizers for x in staged_inners(leaf)]
    inner = getattr(optim, "optimizer", None)
    return [inner] if isinstance(inner, StagedOptimizerBase) else []


def which_state(fp: dict[str, torch.Tensor], work: Path) -> str:
    """'A' or 'B' when ``fp`` equals that recorded state exactly, else a description of the mismatch."""
    for name in ("A", "B"):
        ref = torch.load(work / f"{name}.pt")
        if ref.keys() == fp.keys() and all(torch.equal(ref[k], fp[k]) for k in ref):
            return name
    return "neither: " + ", ".join(sorted(k for k in fp if not any(
        torch.equal(torch.load(work / f"{n}.pt")[k], fp[k]) for n in ("A", "B"))))[:500]


def load_and_identify(work: Path) -> str:
    from optim_staged.megatron import load_checkpoint

    model, optim = build(seed=99)  # another init: everything must come from the checkpoint
    load_checkpoint(model, optim, str(work / "ckpts" / "ckpt"))
    return which_state(fingerprint(model, optim), work)


class KillPoints:
    """Counts the durable/visible operations of a save; SIGKILLs this process before call ``kill_at``."""

    def __init__(self, kill_at: int | None = None) -> None:
        import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa

        from mcore_distill import atomic

        self.kill_at, self.labels, self.armed = kill_at, [], False
        for owner, name in ((os, "fsync"), (os, "replace"), (os, "rename"), (os, "mkdir"), (shutil, "rmtree"),
                            (atomic, "_exchange"), (fsa, "_write_item")):
            setattr(owner, name, self._wrap(name, getattr(owner, name)))

    def _wrap(self, name, fn):
        @functools.wraps(fn)  # keeps the signature: Megatron inspects _write_item's parameters
        def wrapped(*args, **kwargs):
            if self.armed:
                paths = [Path(a).name for a in args[:2] if isinstance(a, str | os.PathLike)]
                self.labels.append(f"{name}:{'->'.join(paths)}")
                if len(self.labels) == self.kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)

        return wrapped


def main(argv: list[str]) -> None:
    cmd, work = argv[0], Path(argv[1])
    _init()
    from optim_staged.megatron import save_checkpoint

    ckpt = work / "ckpts" / "ckpt"
    if cmd == "prepare":
        model, optim = build()
        train(model, optim, range(1))
        torch.save(fingerprint(model, optim), work / "A.pt")
        save_checkpoint(model, optim, str(ckpt))
        train(model, optim, range(1, 2))
        torch.save(fingerprint(model, optim), work / "B.pt")
        points = KillPoints()
        save_checkpoint(model, optim, str(work / "count" / "ckpt"))
        points.armed = True  # a save over an existing checkpoint, as in `kill`: the switch included
        save_checkpoint(model, optim, str(work / "count" / "ckpt"))
        (work / "points.json").write_text(json.dumps(points.labels))
    elif cmd == "kill":
        k, state = int(argv[2]), argv[3]
        (work / f"loaded-{k}.json").write_text(json.dumps(load_and_identify(work)))
        from mcore_distill.atomic import recover_directory, remove_stale

        recover_directory(ckpt)  # the previous kill's temporaries go before counting starts, so
        remove_stale(ckpt)  # that kill point K is the same operation as in `prepare`
        points = KillPoints(kill_at=k)
        model, optim = build()
        train(model, optim, range(1 if state == "A" else 2))
        assert which_state(fingerprint(model, optim), work) == state
        points.armed = True
        save_checkpoint(model, optim, str(ckpt))
        raise SystemExit(f"kill point {k} was not reached ({len(points.labels)} points)")
    elif cmd == "async-kill":
        import megatron.core.dist_checkpointing.strategies.filesystem_async as fsa

        from optim_staged.megatron import async_save_checkpoint

        model, optim = build()
        train(model, optim, range(1))
        torch.save(fingerprint(model, optim), work / "A.pt")
        save_checkpoint(model, optim, str(ckpt))
        train(model, optim, range(1, 2))
        torch.save(fingerprint(model, optim), work / "B.pt")
        writing, real = threading.Event(), fsa._write_item

        @functools.wraps(real)  # Megatron inspects _write_item's signature
        def slow_write(*args, **kwargs):  # the background writer, one item every 50 ms
            writing.set()
            time.sleep(0.05)
            return real(*args, **kwargs)

        fsa._write_item = slow_write
        handle = async_save_checkpoint(model, optim, str(ckpt))
        train(model, optim, range(2, 3))  # the step after async_save_checkpoint()
        assert writing.wait(30) and not handle.done()
        tmp = [p.name for p in ckpt.parent.iterdir() if ".tmp-" in p.name]
        (work / "async-tmp.json").write_text(json.dumps(tmp))
        os.kill(os.getpid(), signal.SIGKILL)
    elif cmd == "helpers":
        import multiprocessing as mp

        model, optim = build()
        train(model, optim, range(1))
        save_checkpoint(model, optim, str(ckpt))
        (work / "helpers.json").write_text(json.dumps([c.pid for c in mp.active_children()]))
        time.sleep(600)
    elif cmd == "verify":
        (work / "loaded-final.json").write_text(json.dumps(load_and_identify(work)))
        before = sorted(p.name for p in ckpt.parent.iterdir())
        model, optim = build()
        train(model, optim, range(1))
        save_checkpoint(model, optim, str(ckpt))  # cleans the temporaries of the killed saves
        after = sorted(p.name for p in ckpt.parent.iterdir())
        (work / "listing.json").write_text(json.dumps({"before": before, "after": after}))
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
