"""Host resources of the staged optimizers: slabs on transparent huge pages
(``SlotConfig.huge_pages``, ``slabs.host_zeros``) and the host lane's thread count."""

from __future__ import annotations

import gc
import mmap
import sys

import pytest
import torch

from optim_staged import SlotConfig, StagedAdamW
from optim_staged.adamw import host_lane_threads
from optim_staged.slabs import host_zeros

LINUX_THP = sys.platform == "linux" and hasattr(mmap, "MADV_HUGEPAGE")


def _vm_flags(ptr: int) -> set[str]:
    """VmFlags of the mapping of this process that contains address ``ptr``."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {ptr:#x}")


@pytest.mark.skipif(not LINUX_THP, reason="needs Linux madvise(MADV_HUGEPAGE)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_host_zeros_is_an_aligned_private_hugepage_mapping(dtype):
    n = (3 << 20) + 17  # not a multiple of a huge page
    t = host_zeros(n, dtype)
    assert t.dtype == dtype and t.shape == (n,) and t.device.type == "cpu"
    assert t.data_ptr() % (2 << 20) == 0
    flags = _vm_flags(t.data_ptr())
    assert "hg" in flags, flags  # advised MADV_HUGEPAGE
    assert "sh" not in flags, flags  # private: shmem's own THP setting would not apply
    assert torch.count_nonzero(t) == 0
    t[-1] = 3
    tail = t[-4:]
    del t
    gc.collect()
    assert tail.tolist() == [0, 0, 0, 3]  # a view keeps the mapping alive


def test_host_zeros_small_or_off_is_plain_torch_zeros():
    small = host_zeros(1000)
    off = host_zeros(4 << 20, huge_pages=False)
    for t in (small, off):
        assert torch.count_nonzero(t) == 0 and t.dtype == torch.float32
    if LINUX_THP:
        assert "hg" not in _vm_flags(off.data_ptr())


def test_staged_adamw_same_bits_on_huge_pages():
    """The slabs' memory changes nothing in the result: huge pages vs torch.zeros, bitwise."""
    shapes = [(1 << 20,), (700, 1500), (33,)]  # > 2 MiB of slab per state key
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in shapes]
    runs = []
    for hp in (True, False):
        ps = [p.clone().requires_grad_() for p in init]
        opt = StagedAdamW(ps, lr=1e-2, weight_decay=0.1,
                          slots=SlotConfig(slot_numel=1 << 18, num_slots=2, huge_pages=hp))
        gg = torch.Generator().manual_seed(1)
        for _ in range(3):
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gg)
            opt.step()
        opt.drain(release=False)
        if hp and LINUX_THP:
            assert "hg" in _vm_flags(opt.slabs["exp_avg"].data_ptr())
        runs.append((ps, [opt.state[p]["exp_avg_sq"].clone() for p in ps]))
    for a, b in zip(*(r[0] for r in runs)):
        assert torch.equal(a, b)
    for a, b in zip(*(r[1] for r in runs)):
        assert torch.equal(a, b)


def test_host_lane_threads_default_is_half():
    assert host_lane_threads(16, None) == 8
    assert host_lane_threads(15, None) == 7
    assert host_lane_threads(1, None) == 1
    assert host_lane_threads(16, 3) == 3


@pytest.mark.skipif(not LINUX_THP, reason="needs Linux madvise(MADV_HUGEPAGE)")
def test_host_zeros_without_kernel_thp_keeps_ordinary_pages(monkeypatch):
    """A kernel built without transparent huge pages answers MADV_HUGEPAGE with EINVAL: the slab
    still works, on ordinary pages (simulated by an advice value no kernel knows)."""
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", 0x7FFF)
    t = host_zeros(3 << 20)
    assert torch.count_nonzero(t) == 0 and t.data_ptr() % (2 << 20) == 0
    assert "hg" not in _vm_flags(t.data_ptr())
    t += 1
    assert t.sum().item() == 3 << 20
