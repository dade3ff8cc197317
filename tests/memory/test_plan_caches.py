"""Emptying the caches before the planner's timed calls (planning/caches.py): the size of the
buffers from the machine's largest cache, and their release."""

import torch
from torch import nn

import iabn
from iabn.planning import caches


def test_the_largest_cache_is_read_from_sysfs_with_a_fallback(tmp_path, monkeypatch):
    for index, size in enumerate(["32K", "1024K", "32768K", "junk"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    monkeypatch.setattr(caches, "CPU_CACHE_SIZES", str(tmp_path / "index*" / "size"))
    caches.largest_cache.cache_clear()
    try:
        assert caches.largest_cache("cpu") == 32768 << 10
        monkeypatch.setattr(caches, "CPU_CACHE_SIZES", str(tmp_path / "none*" / "size"))
        caches.largest_cache.cache_clear()
        assert caches.largest_cache("cpu") == caches.FALLBACK_CACHE_BYTES
    finally:
        caches.largest_cache.cache_clear()


def test_evict_writes_over_twice_the_largest_cache_until_released(monkeypatch):
    monkeypatch.setattr(caches, "largest_cache", lambda device: 1 << 10)
    caches.release()
    caches.evict(torch.device("cpu"))
    caches.evict(torch.device("cpu"))
    (buffer,) = caches._BUFFERS.values()
    assert buffer.numel() == 2 << 10 and buffer.device.type == "cpu"
    assert bool((buffer == 2).all())  # every byte read and written, each time
    caches.release()
    assert not caches._BUFFERS


def test_a_plan_releases_the_buffers(monkeypatch):
    monkeypatch.setattr(caches, "largest_cache", lambda device: 1 << 10)
    caches.evict(torch.device("cpu"))
    assert caches._BUFFERS
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    iabn.plan(model, torch.randn(4, 8), 1.0, allow=["recompute"])
    assert not caches._BUFFERS
