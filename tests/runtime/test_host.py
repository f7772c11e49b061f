"""The page-locked arena's bookkeeping, with a stand-in for the CUDA runtime."""

import torch

from lightning_roundpipe.runtime import host, pinned_bytes


class FakeCudart:
    def __init__(self, fail=False):
        self.fail = fail
        self.live = {}

    def cudaHostRegister(self, ptr, size, flags):
        if self.fail:
            return 2  # cudaErrorMemoryAllocation
        self.live[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr):
        self.live.pop(ptr)
        return 0


def test_registered_bytes_are_counted_until_release(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    start = pinned_bytes()
    arena = host._Arena(pinned=True)
    tensors = [torch.randn(3, 5), torch.randn(7)]
    views = arena.build(tensors, torch.bfloat16)
    assert arena.registered and fake.live
    # views at 512-byte offsets in one buffer, exactly sized, with the values
    assert views[1].data_ptr() - views[0].data_ptr() == 512
    assert arena.nbytes == 1024 and pinned_bytes() == start + 1024
    for v, t in zip(views, tensors, strict=True):
        torch.testing.assert_close(v, t.to(torch.bfloat16))
    arena.release()
    arena.release()  # twice is harmless
    assert not fake.live and pinned_bytes() == start and arena.nbytes == 0


def test_failed_registration_stays_pageable_and_uncounted(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(fail=True))
    start = pinned_bytes()
    arena = host._Arena(pinned=True)
    arena.build([torch.randn(4)], torch.float32)
    assert not arena.registered and pinned_bytes() == start
    assert "cudaHostRegister of 512 bytes failed" in caplog.text
    arena.release()
    assert pinned_bytes() == start
