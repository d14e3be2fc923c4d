"""Run Megatron-Core on a CPU-only machine (gloo), for tests and the CPU demo.

Megatron-Core hard-codes CUDA in a handful of places. :func:`enable` redirects exactly those
calls to the CPU so that the *real* ``GPTModel`` forward/backward, ``get_forward_backward_func``
schedules, Megatron DDP, the distributed optimizer (Adam, Muon), gradient clipping and
``dist_checkpointing`` run unchanged on gloo. Nothing happens on import, and :func:`enable` is a
no-op when CUDA is available, so production code paths are never touched.

Call sites covered (megatron-core 0.19.2; file:line → what breaks without CUDA):

=====================================================  =============================================
``tensor_parallel/random.py`` ``_get/_set_cuda_rng_state``  CUDA RNG (tracker ``fork``, recompute,
  ``model_parallel_cuda_manual_seed``, tracker ``add``)      ``get_rng_state``) → CPU generator state
``rerun_state_machine.py:979,992``                       ``torch.cuda.get/set_rng_state`` → CPU
``utils.py`` ``GlobalMemoryBuffer.get_tensor``            ``torch.cuda.current_device()`` as a device
``pipeline_parallel/schedules.py``                      ``torch.zeros(..., device="cuda")``
``distributed/param_and_grad_buffer.py``                 ``device=torch.cuda.current_device()``
``dist_checkpointing/strategies/filesystem_async.py``    ``torch.cuda.synchronize()``
``optimizer/clip_grads.py:174``                          ``assert grad.type() == 'torch.cuda.FloatTensor'``
``optimizer/distrib_optimizer.py:401,466,758``           ``param.type() in ['torch.cuda.*Tensor']``
``optimizer/optimizer.py:1009,1028``                     same type-string checks (Float16 optimizer)
streams/events (DDP overlap, async checkpoint)           ``torch.cuda.Stream/Event/current_stream``
``torch.cuda.nvtx`` ranges, memory statistics            no-ops / zeros
=====================================================  =============================================

Mechanism, smallest that works:

* a :class:`torch.overrides.TorchFunctionMode` maps every ``device=`` that names CUDA (``"cuda"``,
  ``"cuda:N"``, ``torch.device("cuda")`` or a bare int, which PyTorch reads as a CUDA ordinal) to
  ``"cpu"``, drops ``pin_memory=True``, turns ``.to(cuda)`` into ``.to(cpu)`` and ``.cuda()`` into
  a no-op. Modes are thread-local: the mode is pushed on the thread that calls :func:`enable`, and
  re-entered around every custom ``autograd.Function.backward`` (autograd runs those with an empty
  mode stack; Megatron's activation recomputation builds tensors there).
* ``Tensor.type()`` without arguments reports ``torch.cuda.*`` names for CPU tensors, for
  Megatron's asserts; with arguments it behaves as usual.
* ``torch.cuda`` functions listed above are replaced by CPU equivalents or no-ops.

:func:`disable` restores every patched attribute.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["enable", "disable", "is_enabled", "CpuCompat"]

_MARK = "_mcore_distill_cpu_compat"  # attribute on torch.cuda holding the active CpuCompat


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # PyTorch reads a bare int device as a CUDA ordinal
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _RedirectCudaToCpu(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in (torch.Tensor.cuda, torch.nn.Module.cuda):
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


class _FakeEvent:
    """Stands in for ``torch.cuda.Event``: CPU work is synchronous, so every event is complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _FakeStream:
    """Stands in for ``torch.cuda.Stream``: one in-order CPU 'stream'."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _FakeEvent:
        return event or _FakeEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _FakeStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


_TYPE_NAMES = {
    torch.float32: "FloatTensor", torch.float16: "HalfTensor", torch.bfloat16: "BFloat16Tensor",
    torch.float64: "DoubleTensor", torch.int64: "LongTensor", torch.int32: "IntTensor",
    torch.int16: "ShortTensor", torch.int8: "CharTensor", torch.uint8: "ByteTensor", torch.bool: "BoolTensor",
}


def _cpu_rng_get(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_rng_set(new_state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(new_state)


def _const(value: Any) -> Callable[..., Any]:
    """A fresh function returning ``value``. Each patched attribute gets its own function object:
    torch.compile's trace rules reject one object registered under two torch names."""

    def fn(*args: Any, **kwargs: Any) -> Any:
        return value

    return fn


class CpuCompat:
    """The set of patches, applied by :meth:`start` and undone by :meth:`stop` (or ``with``)."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _RedirectCudaToCpu | None = None

    def _patch(self, owner: Any, name: str, value: Any) -> None:
        self._saved.append((owner, name, getattr(owner, name, None)))
        setattr(owner, name, value)

    def start(self) -> CpuCompat:
        cuda = torch.cuda
        stream = _FakeStream()
        torch_functions: dict[str, Callable[..., Any]] = {
            "current_device": _const(0),
            "set_device": _const(None),
            "device_count": lambda: 1,
            "synchronize": _const(None),
            "empty_cache": _const(None),
            "get_rng_state": lambda *a, **k: torch.get_rng_state(),
            "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
            "get_rng_state_all": lambda: [torch.get_rng_state()],
            "set_rng_state_all": lambda states: torch.set_rng_state(states[0]),
            # the CPU generator stands in for the CUDA one (torch.manual_seed calls manual_seed_all)
            "manual_seed": lambda seed: torch.default_generator.manual_seed(int(seed)),
            "manual_seed_all": lambda seed: torch.default_generator.manual_seed(int(seed)),
            "Stream": _FakeStream,
            "Event": _FakeEvent,
            "current_stream": lambda *a, **k: stream,
            "default_stream": lambda *a, **k: stream,
            "stream": lambda s=None: contextlib.nullcontext(s),
            "memory_allocated": _const(0),
            "max_memory_allocated": _const(0),
            "memory_reserved": _const(0),
            "max_memory_reserved": _const(0),
            "reset_peak_memory_stats": _const(None),
            "reset_max_memory_allocated": _const(None),
        }
        for name, fn in torch_functions.items():
            self._patch(cuda, name, fn)
        for name in ("range_push", "range_pop", "mark"):
            self._patch(cuda.nvtx, name, _const(None))
        self._patch(cuda.nvtx, "range", lambda *a, **k: contextlib.nullcontext())

        random = importlib.import_module("megatron.core.tensor_parallel.random")
        self._patch(random, "_get_cuda_rng_state", _cpu_rng_get)
        self._patch(random, "_set_cuda_rng_state", _cpu_rng_set)

        original_type = torch.Tensor.type

        def cuda_named_type(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs or tensor.device.type != "cpu" or tensor.dtype not in _TYPE_NAMES:
                return original_type(tensor, *args, **kwargs)
            return f"torch.cuda.{_TYPE_NAMES[tensor.dtype]}"

        self._patch(torch.Tensor, "type", cuda_named_type)

        # Autograd runs custom Function.backward (Megatron's recompute among them) with an empty
        # torch-function mode stack: re-enter the redirect there.
        from torch.autograd.function import BackwardCFunction

        original_apply = BackwardCFunction.apply

        def apply_redirected(ctx: Any, *args: Any) -> Any:
            with _RedirectCudaToCpu():
                return original_apply(ctx, *args)

        self._patch(BackwardCFunction, "apply", apply_redirected)

        self._mode = _RedirectCudaToCpu()
        self._mode.__enter__()
        setattr(cuda, _MARK, self)
        return self

    def stop(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        for owner, name, value in reversed(self._saved):
            setattr(owner, name, value)
        self._saved.clear()
        if getattr(torch.cuda, _MARK, None) is self:
            delattr(torch.cuda, _MARK)

    def __enter__(self) -> CpuCompat:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def is_enabled() -> bool:
    """True when :func:`enable` is in force in this process."""
    return getattr(torch.cuda, _MARK, None) is not None


def enable(*, force: bool = False) -> CpuCompat | None:
    """Redirect Megatron-Core's CUDA calls to the CPU.

    Returns the active :class:`CpuCompat` (usable as a context manager), or ``None`` when CUDA is
    available and ``force`` is false (nothing is patched then). Idempotent.
    """
    if torch.cuda.is_available() and not force:
        return None
    active = getattr(torch.cuda, _MARK, None)
    if active is not None:
        return active
    return CpuCompat().start()


def disable() -> None:
    """Undo :func:`enable`; a no-op when it is not in force."""
    active = getattr(torch.cuda, _MARK, None)
    if active is not None:
        active.stop()
