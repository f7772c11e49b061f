"""The page-locked arena's bookkeeping, with a stand-in for the CUDA runtime."""

import pytest
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
    views = arena.allocate([t.shape for t in tensors], torch.bfloat16)
    for v, t in zip(views, tensors, strict=True):
        v.copy_(t)
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
    arena.allocate([torch.Size([4])], torch.float32)
    assert not arena.registered and pinned_bytes() == start
    assert "cudaHostRegister of 512 bytes failed" in caplog.text
    arena.release()
    assert pinned_bytes() == start


# ------------------------------------------- frozen weights as their own master
def _layers():
    """Frozen bf16 weights (own storage, tied across layers, aliased with another
    parameter), a frozen fp32 weight and a trainable bf16 one, small and large
    ones interleaved so page boundaries fall inside and between them."""
    from torch import nn

    torch.manual_seed(0)
    a, b = nn.Linear(40, 30).bfloat16(), nn.Linear(64, 64).bfloat16()  # b: 8 KiB + bias
    c = nn.Linear(8, 8)  # fp32
    tied = nn.Embedding(50, 16).bfloat16()
    base = torch.randn(2, 24).bfloat16()
    d, e = nn.Linear(24, 1, bias=False), nn.Linear(24, 1, bias=False)
    d.weight, e.weight = nn.Parameter(base[:1]), nn.Parameter(base[1:])  # one storage
    for p in [*a.parameters(), *c.parameters(), *tied.parameters(), d.weight, e.weight]:
        p.requires_grad_(False)
    return [nn.ModuleList([tied, a]), nn.ModuleList([b, c, d, e]), nn.ModuleList([tied])]


def test_frozen_weights_in_the_compute_dtype_are_their_own_master_copy():
    layers = _layers()
    params = {id(p): p for layer in layers for p in layer.parameters()}
    before = {i: p.detach().clone() for i, p in params.items()}
    state = host.HostState(layers, torch.bfloat16)
    shared = {id(hp.param) for hp in state.params if hp.shared}
    tied, a = layers[0]
    b = layers[1][0]
    # frozen and bf16 and alone in their storage: the embedding (tied into two
    # layers) and a's weight and bias; not the trainable b, the fp32 c, nor d and
    # e, which share one storage
    assert shared == {id(tied.weight), id(a.weight), id(a.bias)}
    for hp in state.params:
        assert params[id(hp.param)] is hp.param  # the same Parameter objects
        torch.testing.assert_close(hp.param, before[id(hp.param)], atol=0, rtol=0)
        torch.testing.assert_close(hp.master, before[id(hp.param)].bfloat16(), atol=0, rtol=0)
        if hp.shared:  # its data is the master, in a storage of its own
            assert hp.param.data_ptr() == hp.master.data_ptr()
            assert hp.param.untyped_storage().nbytes() == hp.nbytes
        else:
            assert hp.param.data_ptr() != hp.master.data_ptr()
    mem = state.host_bytes()
    assert mem["shared"] == sum(hp.nbytes for hp in state.params if hp.shared) > 0
    assert mem["master"] > mem["shared"]
    # nothing to copy for them after a step; the others are refreshed
    with torch.no_grad():
        b.weight.add_(1)
    state.refresh_masters()
    torch.testing.assert_close(state.params[3].master, b.weight, atol=0, rtol=0)
    state.free()
    assert state.host_bytes()["master"] == 0


def test_a_freed_arena_keeps_the_frozen_weights_and_returns_the_other_pages():
    from torch import nn

    torch.manual_seed(0)
    small = [nn.Linear(3, 5).bfloat16().requires_grad_(False) for _ in range(3)]
    # frozen but not in the compute dtype: a master copy of its own in the
    # frozen weights' arena, 24 KiB, six pages
    big = nn.Linear(128, 96).requires_grad_(False)
    layers = [nn.ModuleList([small[0], big, small[1]]), small[2]]
    values = [p.detach().clone() for m in small for p in m.parameters()]
    state = host.HostState(layers, torch.bfloat16)
    mapping = state.pool._map
    hp = next(hp for hp in state.params if hp.param is big.weight)
    assert not hp.shared
    offset, nbytes = hp.offset, hp.nbytes
    assert torch.frombuffer(mapping, dtype=torch.uint8)[offset : offset + nbytes].any()
    state.free()
    for v, p in zip(values, (p for m in small for p in m.parameters()), strict=True):
        torch.testing.assert_close(p, v, atol=0, rtol=0)  # shared pages untouched
    # the whole pages inside the fp32 weight's master went back (read as zeros)
    page = 4096
    lo = -(-offset // page) * page
    hi = (offset + nbytes) // page * page
    assert hi - lo >= 4 * page
    assert not torch.frombuffer(mapping, dtype=torch.uint8)[lo:hi].any()


def test_frozen_weights_in_the_arena_save_like_ordinary_parameters(tmp_path):
    import io

    from safetensors.torch import load_file, save_file
    from torch import nn

    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256)).bfloat16()
    model.requires_grad_(False)
    model[1].requires_grad_(True)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    state = host.HostState(list(model), torch.bfloat16)
    assert sum(hp.shared for hp in state.params) == 2
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # each tensor's bytes, not the whole arena
    assert len(buf.getvalue()) < 1.1 * sum(v.nbytes for v in expected.values()) + 4096
    save_file(model.state_dict(), tmp_path / "m.safetensors")  # no "shared tensors" refusal
    loaded = load_file(tmp_path / "m.safetensors")
    for k, v in expected.items():
        torch.testing.assert_close(loaded[k], v, atol=0, rtol=0)
    state.free()


def test_moving_frozen_weights_into_the_arena_never_holds_them_twice():
    # peak resident memory of a fresh process: 256 MiB of frozen bf16 weights
    # (16 parameters) moved into the arena one at a time
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(
        """
        import resource, torch
        from torch import nn
        from lightning_roundpipe.runtime import host
        layers = []
        for _ in range(16):
            layer = nn.Module()
            layer.w = nn.Parameter(torch.ones(8 << 20, dtype=torch.bfloat16), requires_grad=False)
            layers.append(layer)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        state = host.HostState(layers, torch.bfloat16)
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        assert all(hp.shared for hp in state.params)
        print((after - before) // 1024)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    grown = int(done.stdout.split()[-1])  # MiB above the weights' own peak
    assert grown < 64, grown  # one 16 MiB parameter in flight, not all 256 MiB


def test_layers_with_sparse_buffers_build_and_keep_them():
    from torch import nn

    layer = nn.Linear(4, 4).requires_grad_(False)
    adjacency = torch.eye(4).to_sparse()
    layer.register_buffer("adjacency", adjacency)
    state = host.HostState([layer], torch.float32)
    assert layer.adjacency is adjacency and all(hp.shared for hp in state.params)
    state.free()


def test_a_stage_goes_up_from_the_frozen_range_and_its_versions_trainable_range():
    """A LoRA-like layer stack (frozen bf16 base, fp32 adapters) with two master
    copies: every stage's device buffer, filled from its frozen range and the
    trainable range of one version's copy (whole or window by window, as the
    prefetch does), holds exactly that version's weights."""
    from torch import nn

    from lightning_roundpipe.runtime.worker import _copy_range

    torch.manual_seed(0)
    base = [nn.Linear(40, 40).bfloat16().requires_grad_(False) for _ in range(3)]
    adapters = [nn.Linear(40, 3) for _ in range(3)]
    layers = [nn.ModuleList([b, a]) for b, a in zip(base, adapters, strict=True)]
    state = host.HostState(layers, torch.bfloat16, copies=2)
    assert all(hp.shared for hp in state.params if not hp.trainable)
    assert all(len(hp.masters) == (2 if hp.trainable else 1) for hp in state.params)
    for hp in state.params:
        if hp.trainable:  # version 1 differs from version 0
            torch.testing.assert_close(hp.master_for(1), hp.master_for(0), atol=0, rtol=0)
            hp.master_for(1).add_(1)
    for start, stop in [(0, 1), (1, 3), (0, 3)]:
        span = state.span(start, stop)
        for version in (0, 1, 2):
            whole = torch.zeros(span.nbytes, dtype=torch.uint8)
            sources = state.sources(span, version)
            assert len(sources) == 2
            _copy_range(whole, sources, 0, span.nbytes)
            pieces = torch.zeros(span.nbytes, dtype=torch.uint8)
            step = -(-span.nbytes // 3)
            for a in range(0, span.nbytes, step):
                _copy_range(pieces, sources, a, min(a + step, span.nbytes))
            for flat in (whole, pieces):
                views = span.views(flat, torch.bfloat16)
                assert set(views) == {hp.index for hp in state.stage_params(start, stop)}
                for i, v in views.items():
                    want = state.params[i].master_for(version)
                    torch.testing.assert_close(v, want, atol=0, rtol=0)
    trained = sum(hp.nbytes for hp in state.params if hp.trainable)
    assert state.host_bytes()["master"] == sum(hp.nbytes for hp in state.params) + trained
    # a parameter changed outside a step reaches both copies
    with torch.no_grad():
        adapters[0].weight.fill_(0.5)
    state.refresh_masters()
    hp = next(hp for hp in state.params if hp.param is adapters[0].weight)
    for m in hp.masters:
        assert bool((m == 0.5).all())
    state.free()
    for b in base:  # the frozen base keeps its values
        assert b.weight.numel() and torch.isfinite(b.weight).all()


def test_the_copies_option_is_checked():
    from torch import nn

    with pytest.raises(ValueError, match="copies must be 1 or 2, got 3"):
        host.HostState([nn.Linear(2, 2)], torch.float32, copies=3)


def test_the_available_host_memory_heeds_a_containers_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 8000000 kB\nMemFree: 1000 kB\nMemAvailable: 4000000 kB\n")
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    stat = tmp_path / "memory.stat"
    group = [(str(limit), str(usage), str(stat))]
    assert host.host_available(str(meminfo), ()) == 4000000 * 1024  # MemAvailable, not MemFree
    limit.write_text("max\n")
    usage.write_text("123\n")
    assert host.host_available(str(meminfo), group) == 4000000 * 1024
    limit.write_text(f"{3 * 2**30}\n")  # a container limit of 3 GiB, 1 GiB used
    usage.write_text(f"{2**30}\n")
    assert host.host_available(str(meminfo), group) == 2 * 2**30  # (no memory.stat)
    # the usage counts file cache the kernel gives back: it is free memory
    stat.write_text(f"anon 1000\nfile {2**29}\ninactive_file {2**28}\nactive_file 5\n")
    assert host.host_available(str(meminfo), group) == 2 * 2**30 + 2**28
    v1_unlimited = tmp_path / "limit_in_bytes"
    v1_unlimited.write_text("9223372036854771712\n")
    got = host.host_available(str(meminfo), [(str(v1_unlimited), str(usage), str(stat))])
    assert got == 4000000 * 1024
    # no meminfo: the free pages, still capped by the container
    capped = host.host_available(str(tmp_path / "missing"), group)
    assert capped is not None and capped <= 2 * 2**30 + 2**28


class ScaledParameter(torch.nn.Parameter):
    """Stands in for a quantized weight (bitsandbytes' Params4bit): a
    parameter subclass carrying more than its values."""


@pytest.mark.parametrize("kind", ["subclass", "integer", "lazy"])
def test_parameters_that_are_more_than_floating_values_are_refused(kind):
    """(a 4-bit QLoRA base failed inside a worker: the workers rebind plain
    nn.Parameters from the master copies, which lose a quantized weight's
    packing and scales)"""
    layer = torch.nn.Linear(4, 4) if kind != "lazy" else torch.nn.LazyLinear(4)
    if kind == "subclass":
        layer.weight = ScaledParameter(layer.weight.detach(), requires_grad=False)
    elif kind == "integer":
        layer.weight = torch.nn.Parameter(torch.ones(4, 4, dtype=torch.int8), requires_grad=False)
    before = layer.weight
    expected = {
        "subclass": r"'weight' of type .*ScaledParameter; .*quantized bases .* bf16",
        "integer": r"'weight' of dtype torch.int8; .*quantized",
        "lazy": r"'weight' of type .*UninitializedParameter; .*run one forward",
    }[kind]
    with pytest.raises(
        TypeError,
        match=r"pipeline layer 1 \(" + type(layer).__name__ + r"\) has parameter " + expected,
    ):
        host.HostState([torch.nn.Linear(4, 4), layer], torch.float32)
    assert layer.weight is before  # nothing was moved


def test_within_staging_makes_stages_smaller_until_their_gradient_staging_fits():
    """A first plan whose stages' gradient downloads stage more page-locked
    memory than the host leaves is replaced by one planned within a smaller
    stage cap (falling by sqrt(2) from its largest stage) whose staging fits;
    a first plan that fits is kept, and so is one no smaller stages help."""
    from lightning_roundpipe.plan import LayerCosts, PlanError
    from lightning_roundpipe.plan.decide import initial_plan
    from lightning_roundpipe.runtime.host import plan_staging_bytes, within_staging

    grads = [1000] * 16  # fp32 gradient bytes per layer
    costs = LayerCosts([1.0] * 16, [2.0] * 16, memory=[3000] * 16)
    first = initial_plan(costs, 1, 4, given=None, async_optimizer=True, memory_limit=None)
    asked = []

    def plan_for(cap):
        asked.append(cap)
        return initial_plan(
            costs, 1, 4, given=None, async_optimizer=True, memory_limit=None, size_limit=int(cap)
        )

    def sizes(plan):
        return plan.stage_memory(costs)

    staged = plan_staging_bytes(first, grads, 1)
    assert within_staging(first, plan_for, costs, grads, 1, staged) == (first, None)
    assert asked == []
    plan, cap = within_staging(first, plan_for, costs, grads, 1, staged * 0.6)
    assert plan_staging_bytes(plan, grads, 1) <= staged * 0.6 < staged
    assert max(plan.stage_memory(costs)) <= cap < max(sizes(first))
    assert asked[0] == pytest.approx(max(sizes(first)) / 2**0.5)
    # below one layer's gradients nothing fits: the first plan stays
    assert within_staging(first, plan_for, costs, grads, 1, 500) == (first, None)

    def refusing(cap):
        raise PlanError("no plan")

    assert within_staging(first, refusing, costs, grads, 1, 10) == (first, None)
