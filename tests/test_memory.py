"""Activation memory known before the first step: the probes' prediction of
what each layer keeps equals what the profiler measures in a real step (dense,
MoE, eager attention whose scores grow with the square of the sequence,
padding, tiling, fp32 and bf16); a plan that would not fit is replaced before
anything runs; the predicted peak follows a fit's measured peak memory on CPU;
``python -m lightning_roundpipe.plan estimate`` from a config file."""

import copy
import dataclasses
import json
import sys

import pytest
import torch
from test_adapters import attached_engine, tiny
from torch import nn

from lightning_roundpipe.models import CausalLMAdapter
from lightning_roundpipe.models.attention import backward_workspace
from lightning_roundpipe.models.memory import (
    _backward_working,
    _fit_trace,
    _Fp32Matmuls,
    _LiveBytes,
    _probe_inputs,
    _quadratic,
    applied_tiles,
    longest_sequence,
)
from lightning_roundpipe.plan.cli import main
from lightning_roundpipe.runtime import RoundPipeEngine

transformers = pytest.importorskip("transformers")


def test_three_points_give_the_quadratic():
    f = [3 + 5 * x + 0.5 * x * x for x in (16, 32, 48)]
    assert _quadratic((16, 32, 48), f) == pytest.approx((3, 5, 0.5))
    assert longest_sequence(lambda s: s * s <= 1000) == 31
    assert longest_sequence(lambda s: False) == 0
    assert applied_tiles({"loss_chunk": 10, "mlp_tile": 100}, 50) == {"loss_chunk": 10}


def test_the_longest_sequence_search_checks_lengths_below_what_it_finds():
    """A predicate monotone only mostly (lengths 300 to 400 do not fit): the
    bisection alone finds an edge above that gap; with checks, a checked
    length in the gap sends the search below it, to the first edge."""

    def fits(s):
        return s <= 1000 and not 300 <= s <= 400

    assert longest_sequence(fits) == 1000
    assert longest_sequence(fits, checks=16) == 299
    tried = []
    assert longest_sequence(lambda s: tried.append(s) or s <= 1000, checks=16) == 1000
    assert len(tried) == len(set(tried)) <= 24 + 1 + 16  # monotone: the checks pass


def measured_and_predicted(kind, seq, precision, tile_memory, padded=True, **config):
    """Per layer: bytes saved for backward as the profiler measured them in a
    step of 2 micro-batches of 2 sequences (one ``padded``); the activation
    model that predicts them, and the tiles applied."""
    model = tiny(kind, max_position_embeddings=seq, **config)
    adapter = CausalLMAdapter(model, "model")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 101, (4, seq), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, -3:] = 0
    with RoundPipeEngine(
        adapter.layers(),
        ["cpu"] * 2,
        2,
        device_memory_limit=2**30,
        precision=precision,
        tile_memory=tile_memory,
        plan="2|2|2",
    ) as eng:
        adapter.attach(eng)
        try:
            for _ in range(3):  # the profiler's two iterations and one more
                model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
                eng.synchronize()
            measured = [
                a - b for a, b in zip(eng.measured_costs().memory, eng._costs.memory, strict=True)
            ]
            tiles = applied_tiles(adapter.tile_sizes(loss=True), 2 * seq)
            act = adapter.activation_model(eng.compute_dtype, tiles, loss=True, mask=padded)
            assert eng.predicted_peaks is not None
        finally:
            adapter.detach()
    return measured, act, tiles


@pytest.mark.parametrize(
    ("kind", "precision", "tile_memory"),
    [
        ("llama", "32-true", None),
        ("llama", "bf16-mixed", 6000),  # chunked loss and tiled MLP
        ("qwen3_moe", "bf16-mixed", None),
        ("gemma2", "32-true", None),  # eager attention: scores kept, quadratic
    ],
)
def test_the_predicted_saved_bytes_are_what_a_step_saves(kind, precision, tile_memory):
    measured, act, tiles = measured_and_predicted(kind, 192, precision, tile_memory)
    predicted = act.saved_bytes(192, 2)
    if tile_memory:
        assert set(tiles) == {"loss_chunk", "mlp_tile"}
        # (not the head: a chunked loss keeps its input and that input's
        # gradient, but the profiler also counts, by address, the chunks'
        # short-lived tensors, whatever the allocator reuses)
        measured, predicted = measured[:-1], predicted[:-1]
    for layer, (m, p) in enumerate(zip(measured, predicted, strict=True)):
        assert p == pytest.approx(m, rel=0.02, abs=64), f"layer {layer}"


def test_a_plan_that_would_not_fit_is_replaced_before_the_first_step(caplog):
    """Weights alone fit one stage; with the activations of 512-token
    sequences the engine splits the layers before anything runs."""
    model = tiny("llama", max_position_embeddings=512, num_hidden_layers=4)
    ids = torch.randint(0, 101, (2, 512))
    opts = dict(device_memory_limit=5_000_000, tile_memory=None)
    with attached_engine(model, 1, 1, **opts) as (_, eng):
        start = str(eng.plan)
        with caplog.at_level("INFO", logger="lightning_roundpipe.runtime.engine"):
            model(input_ids=ids, labels=ids).loss.backward()
            eng.synchronize()
        assert str(eng.plan) != start
        assert max(eng.predicted_peaks) <= 5_000_000
    assert "before the first step" in caplog.text


def test_long_sequences_let_stages_take_more_than_half_of_the_gpu(caplog):
    """On a GPU the limit is half of a worker's free memory (the other half
    holds the next stage's prefetched weights). When the activations of even
    one layer need more, a stage may take more and the next stage's weights
    less: the engine's limit grows before the first step, the run goes on
    and later decisions keep that limit. (CPU workers have no such budget:
    the test gives the engine the one a GPU would.)"""
    model = tiny("llama", max_position_embeddings=512, num_hidden_layers=4)
    ids = torch.randint(0, 101, (2, 512))
    opts = dict(device_memory_limit=3_000_000, tile_memory=None)
    with attached_engine(model, 1, 1, **opts) as (_, eng):
        eng._budget = 6_000_000  # what a GPU with 6 MB free would give
        with caplog.at_level("INFO", logger="lightning_roundpipe.runtime.engine"):
            for _ in range(3):  # past the profiler's measurements
                model(input_ids=ids, labels=ids).loss.backward()
                eng.synchronize()
        # 0.9 x 6 MB less a quarter of it for the next stage's weights
        assert eng.memory_limit == 3_900_000
        assert 3_000_000 < max(eng.predicted_peaks) <= 3_900_000
    assert "the next stage's weights need at most 1.5e+06" in caplog.text


@pytest.mark.parametrize(
    "plan", ["4|2|1,1,1,1", "2,2|2|2,2", "1,1,1,1|2|4", "1,1,1,1|2|4|layered", "4|2|2,2|layered"]
)
def test_the_estimated_host_boundaries_bound_what_a_step_holds(plan):
    """The estimate's host memory for boundary activations counts the inputs
    of the backward stages (and the fused one) that a micro-batch keeps until
    its backward, plus two values in flight between forward stages: at
    least the most a step holds at once, and no more than every value it
    writes, up to the positions, which the estimate counts per sequence, the
    engine per micro-batch."""
    from lightning_roundpipe.models.estimate import boundary_bytes
    from lightning_roundpipe.plan import StagePlan

    model = tiny("llama", num_hidden_layers=4)
    ids = torch.randint(0, 101, (4, 24))
    # one device: both micro-batches' forward stages run before their backward
    with attached_engine(model, 1, 2, plan=plan, tile_memory=None) as (_, eng):
        model(input_ids=ids, labels=ids).loss.backward()
        eng.synchronize()
        written, peak = eng.boundary_bytes, eng.boundary_peak
    predicted = 2 * boundary_bytes(
        StagePlan.parse(plan, 6), 2 * 24, model.config.hidden_size, 4
    )  # 2 micro-batches of 2 sequences, fp32
    assert 0 < peak <= predicted <= 1.05 * written
    if "4|2|" in plan:  # no forward-only boundary: all of it is held at once
        assert predicted <= 1.05 * peak


@pytest.mark.parametrize(("limit", "mode"), [(4_000_000, "layered"), (3_300_000, "rewalk")])
def test_too_little_host_memory_for_one_layer_stages_gets_a_layered_plan(caplog, limit, mode):
    """A block with its activations fits a stage, two plain ones do not; with
    host memory (activation_memory) for fewer boundary values than one-layer
    stages keep, the engine plans larger, layered backward stages before the
    first step: the step holds fewer boundary bytes and its loss and
    gradients equal plain PyTorch's. With a device limit that leaves no
    room for a three-layer stage's two layer inputs (a block: 3.0 MB with
    its activations, a layer input 0.14 MB) the stages are rewalked."""
    import copy

    model = tiny("llama", max_position_embeddings=512, num_hidden_layers=6)
    ids = torch.randint(0, 101, (2, 512))
    ref = copy.deepcopy(model)
    expected = ref(input_ids=ids, labels=ids).loss
    expected.backward()
    held = {}
    for budget in (None, 400_000):  # one-layer stages keep 7 values of 139 KB
        run = copy.deepcopy(model)
        opts = dict(device_memory_limit=limit, tile_memory=None, activation_memory=budget)
        with (
            caplog.at_level("INFO", logger="lightning_roundpipe.runtime.engine"),
            attached_engine(run, 1, 1, profile_iterations=0, **opts) as (_, eng),
        ):
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            eng.synchronize()
            assert eng.plan.layered == (budget is not None)
            assert eng.plan.rewalk == (budget is not None and mode == "rewalk")
            assert max(eng.predicted_peaks) <= limit
            held[budget] = eng.boundary_peak
        torch.testing.assert_close(loss, expected)
        for (name, p), q in zip(run.named_parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert 0 < held[400_000] <= 400_000 < held[None]
    assert "backward stages recompute one layer at a time" in caplog.text
    assert ("each layer's input again from the stage's" in caplog.text) == (mode == "rewalk")


def test_out_of_memory_in_a_layered_stage_counts_the_activations_larger(monkeypatch):
    """A layered stage runs out of device memory in the first batch (injected
    on CPU workers): the strategy counts the predicted activations a quarter
    larger, which no layered stage fits; the batch runs again with the
    stages rewalked (halving the stages' weights would have given one-layer
    stages, which keep more boundary values than activation_memory allows),
    and training equals plain Lightning's."""
    import lightning as L
    from test_adapters import LM, QUIET
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_roundpipe import RoundPipeStrategy
    from lightning_roundpipe.runtime import worker as worker_mod

    failed = []
    original = worker_mod.Worker._layers

    def layers(self, job, *args, **kwargs):
        if job.task.layered and not job.task.rewalk and job.call.iteration == 0:
            failed.append(str(job.task))
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return original(self, job, *args, **kwargs)

    monkeypatch.setattr(worker_mod.Worker, "_layers", layers)
    ids = torch.randint(0, 101, (8, 512), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(ids, torch.ones_like(ids), ids), batch_size=4)
    model = tiny("llama", max_position_embeddings=512, num_hidden_layers=6)
    ref, mod = LM(model), LM(copy.deepcopy(model))

    def fit(module, strategy):
        L.seed_everything(0)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, **QUIET)
        trainer.fit(module, data)

    fit(ref, "auto")
    plans = []

    def end(self, *args):
        engine = self.trainer.strategy.engine
        plans.append((str(engine.plan), engine.activation_scale))

    monkeypatch.setattr(LM, "on_train_batch_end", end)
    strategy = RoundPipeStrategy(
        async_optimizer=False,
        num_microbatches=2,
        device_memory_limit=4_000_000,
        tile_memory=None,
        activation_memory=400_000,  # fewer boundary values than one-layer stages keep
    )
    with pytest.warns(UserWarning, match=r"ran out of memory in stage B1 \(layers 5-7\)") as w:
        fit(mod, strategy)
    message = str(next(x.message for x in w if "re-planned" in str(x.message)))
    assert (
        "re-planned with activations counted 1.25x their prediction (stage B1 was predicted to "
        "need 3.394e+06 bytes of the 4e+06 a stage may use): plan 5|3|2,3|layered -> "
        "5|3|2,3|rewalk, 2 -> 2 micro-batches" in message
    )
    assert len(failed) == 1 and plans == [("5|3|2,3|rewalk", 1.25)] * 2
    torch.testing.assert_close(torch.stack(mod.losses), torch.stack(ref.losses))
    for (name, p), q in zip(mod.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc: Linux")
@pytest.mark.xdist_group("long_fit")  # one test process runs the fits for both
def test_the_predicted_peak_follows_the_measured_peak(long_fit_peaks):
    """One CPU worker, fp32, the loss chunked and the MLPs tiled: how much the
    peak grows from 256 to 8,192 tokens per sequence (the fixed costs of the
    process cancel), measured in fresh processes and predicted."""
    (m_short, p_short), (m_long, p_long) = long_fit_peaks[256], long_fit_peaks[8192]
    measured, predicted = m_long - m_short, p_long - p_short
    # the prediction bounds the live growth, not far above it (1.11x: the
    # blocks' transients are measured by the probes, the head's loss chunk
    # is modelled). With the heap's slack resident memory grows by 2x the
    # live tensors' growth here, whatever the prediction, so it is kept out
    # (the fits' ``live``)
    assert measured <= predicted <= 1.25 * measured, (measured, predicted)


def test_on_cuda_the_attention_backward_adds_its_workspace_split_when_tiled():
    """The CPU flash kernel's backward has no workspace; CUDA's has one
    (fp32 query-gradient accumulator, expanded key/value gradients), which
    a tiled block's split backward holds for one head group at a time. It
    is added where the probes saw the attention's backward run, not to the
    block's largest moment elsewhere (an untiled MLP's gradients)."""
    model = tiny("llama")
    config = model.config
    adapter = CausalLMAdapter(model, "model")
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    seq = 4096
    for tiles, split in (({}, False), ({"mlp_tile": 64}, True)):
        act = adapter.activation_model(torch.float32, tiles, loss=False)
        assert act.attention == (heads, kv, head_dim)
        cpu, cuda = act.transient_bytes(seq), act.transient_bytes(seq, cuda=True)
        work = backward_workspace(seq, heads, kv, head_dim, 4, split=split)
        # (the embedding and the head: no attention)
        assert cuda[0] == cpu[0] and cuda[-1] == cpu[-1]
        for w, a, b in zip(act.working[1:-1], cpu[1:-1], cuda[1:-1], strict=True):
            assert w.attention is not None  # the probes saw the flash kernel
            at_attention = max(c0 + c1 * seq + c2 * seq**2 for c0, c1, c2 in w.attention)
            assert b == pytest.approx(max(a, at_attention + work))
            assert a <= b <= a + work


def test_the_dense_mask_a_stage_builds_is_counted_once_per_stage():
    """A padded (or packed) batch makes the stage build a boolean
    ``(batch, 1, sequence, sequence)`` mask under SDPA, and eager attention
    always one in the compute dtype, kept through the stage's run outside
    any layer: no probe saw it (a third short of a one-block bf16 stage's
    peak at 32K padded tokens). Counted in every block's transient bytes,
    of which a stage counts its largest: once."""
    seq, mb = 4096, 2
    for attention, padded, element in (("sdpa", False, 0), ("sdpa", True, 1), ("eager", False, 4)):
        model = tiny("llama")
        model.config._attn_implementation = attention
        adapter = CausalLMAdapter(model, "model")
        act = adapter.activation_model(torch.float32, {}, loss=False, mask=padded)
        blocks = len(act.saved) - 2
        kind = [("full_attention", element)] if element else [None]
        assert act.masks == (None, *kind * blocks, None), attention
        without = dataclasses.replace(act, masks=())
        diff = [
            b - a
            for a, b in zip(
                without.transient_bytes(seq, mb), act.transient_bytes(seq, mb), strict=True
            )
        ]
        assert diff == [0, *[mb * seq * seq * element] * blocks, 0]
        once = act.stage_peak(1, 1 + blocks, seq, mb) - without.stage_peak(1, 1 + blocks, seq, mb)
        assert once == mb * seq * seq * element


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_the_probes_run_expert_products_in_fp32_and_round_back():
    """Mixture-of-Experts blocks multiply with torch._grouped_mm; in bf16 on
    CPU its backward layouts run ~60x slower than in fp32 (a Mixtral-8x7B
    block's probes took 5 minutes, 45 s in fp32): the probes compute it in
    fp32 and hand back bf16 of the same shape and values."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._grouped_mm.default:
                seen.append([a.dtype for a in args if isinstance(a, torch.Tensor)])
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 8, generator=g).bfloat16()
    b = torch.randn(2, 4, 8, generator=g).bfloat16().transpose(1, 2)  # (experts, in, out)
    offs = torch.tensor([2, 6], dtype=torch.int32)
    with Spy(), _Fp32Matmuls():  # (the spy sees what the probe mode passes on)
        got = torch._grouped_mm(a, b, offs=offs)
    assert seen == [[torch.float32, torch.float32, torch.int32]]
    want = torch.cat([a[:2].float() @ b[0].float(), a[2:].float() @ b[1].float()])
    assert got.dtype == torch.bfloat16 and got.shape == (6, 4)
    torch.testing.assert_close(got, want.bfloat16())


def test_calls_that_differ_in_the_loss_chunk_alone_probe_the_blocks_once():
    """The estimate's search asks for activation models with and without a
    chunked loss: the blocks' probes (minutes for a Mixture-of-Experts block)
    are shared, a tiled MLP is probed anew, and every model equals one
    probed from scratch."""
    model = tiny("llama")
    adapter = CausalLMAdapter(model, "model")
    calls = []
    # (hooks travel with the probes' copies of the block)
    adapter.layers()[1].register_forward_hook(lambda *_: calls.append(1))
    whole = adapter.activation_model(torch.float32, {}, loss=True)
    probed = len(calls)
    assert probed > 0
    chunked = adapter.activation_model(torch.float32, {"loss_chunk": 8}, loss=True)
    assert len(calls) == probed
    tiled = adapter.activation_model(torch.float32, {"loss_chunk": 8, "mlp_tile": 8}, loss=True)
    assert len(calls) > probed
    assert chunked.saved[1:-1] == whole.saved[1:-1] and chunked.saved[-1] != whole.saved[-1]
    for tiles, got in (({"loss_chunk": 8}, chunked), ({"loss_chunk": 8, "mlp_tile": 8}, tiled)):
        fresh = CausalLMAdapter(model, "model").activation_model(torch.float32, tiles, loss=True)
        assert fresh == got


def test_live_bytes_trace_what_ops_create_until_it_is_freed():
    """The probes' tracker: a storage counts from the op that creates it
    until it dies; views, in-place results and tensors made outside do not
    count. From ``start`` it traces the bytes above what was alive then,
    op by op: outside tiles, at each tile's start, within a tile (op by op,
    the most over tiles; nested tiles count in the outermost), and at the
    attention's backward."""
    outside = torch.zeros(1000)
    live = _LiveBytes()
    with live:
        kept = torch.ones(250)  # 1,000 bytes
        outside.add_(1)
        view = kept[:10].view(2, 5)
        live.start()
        assert live.base == 1000 and live.outside == []
        big = torch.cat([kept, kept])  # 2,000
        del big, view
        for size in (500, 250):  # two tiles
            live.tile(True)
            a = torch.ones(size)
            live.tile(True)  # (nested: counts in the outer one)
            b = torch.ones(250)
            live.tile(False)
            del a, b
            live.tile(False)
        q = torch.randn(1, 2, 8, 4, requires_grad=True)
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        out.backward(torch.ones_like(out))
    assert live.outside[0] == 2000
    assert live.tile_starts == [0, 0] and live.tile_ops == [2000, 3000]
    assert len(live.attention) == 1 and live.attention[0] >= 2 * q.nbytes  # dq and more
    del kept


def test_each_moment_of_a_backward_becomes_a_polynomial_and_only_the_largest_are_kept():
    """Traces of three lengths line up op by op; an op's bytes are fitted
    (a quadratic, or a line within tiles) and the ones another bounds are
    dropped: the largest at a long length may be small at the probes'."""
    xs = (16, 32, 48)
    # op 0: a weight-sized 5,000 bytes; op 1: 10 bytes per token
    traces = [[5000 + x, 10 * x] for x in xs]
    fitted = _fit_trace(xs, traces, line=False)
    assert sorted(fitted) == [pytest.approx((0, 10, 0)), pytest.approx((5000, 1, 0))]
    assert max(c0 + c1 * 4096 for c0, c1, _ in fitted) == pytest.approx(40960)
    # one op bounded by another is dropped
    assert _fit_trace(xs, [[x, 2 * x] for x in xs], line=True) == (pytest.approx((0, 2, 0)),)
    # traces that do not line up: the largest of each
    assert _fit_trace(xs, [[1, 16], [32], [1, 2, 48]], line=True) == (pytest.approx((0, 1, 0)),)


def wide_lora(seq: int) -> torch.nn.Module:
    """A Llama block 512 wide with 128-wide heads, LoRA on every linear
    layer, on the meta device (:func:`~lightning_roundpipe.models.estimate._meta_model`)."""
    from lightning_roundpipe.models.estimate import _meta_model

    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1792,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=1000,
        max_position_embeddings=seq,
    )
    return _meta_model(config, 16)


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gemma2", "wide-lora"])
def test_the_probes_predict_a_long_blocks_backward_working_memory(kind):
    """What a block's backward works with, predicted from probes of 16 to
    48 tokens, is what it works with at a long length in short MLP tiles,
    exactly: flash attention (linear in the sequence) and eager attention
    (gemma2: scores, quadratic); a wide block with LoRA in bf16, whose
    largest moment at the probes' lengths (weight-sized) is not its largest
    at a long one."""
    from lightning_roundpipe.models.estimate import materialiser

    seq, tile = (2048, 128) if kind == "wide-lora" else (1024, 64)
    if kind == "wide-lora":
        model, dtype, prepare = wide_lora(seq), torch.bfloat16, materialiser(torch.bfloat16)
    else:
        model, dtype, prepare = tiny(kind, max_position_embeddings=seq), torch.float32, None
    adapter = CausalLMAdapter(model, "model")
    act = adapter.activation_model(dtype, {"mlp_tile": tile}, loss=False, prepare=prepare)
    layers = [layer if prepare is None else prepare(layer) for layer in adapter.layers()[:3]]
    x = _probe_inputs(layers[0], dtype, seq, model.config.vocab_size, False, False, False)
    for i in (1, 2):
        inputs = dict(x, mlp_tile=tile)
        leaf = inputs["hidden_states"].detach().requires_grad_()
        inputs["hidden_states"] = leaf
        live = _LiveBytes()
        # bf16 products in fp32 underneath, as in the probes (and in the
        # backward's trace): the same bytes, faster
        with _Fp32Matmuls(), torch.enable_grad(), live:
            out = layers[i](**inputs)
        got = _backward_working(live, out, leaf)
        assert got is not None and act.working[i] is not None
        assert bool(got.attention) == (kind != "gemma2")
        measured = max(
            max(got.outside),
            max(got.tile_starts) + max(got.tile_ops),
            max(got.attention, default=0),
        )
        predicted = act.working[i].bytes(seq, 1, tile, 0.0)
        assert predicted == pytest.approx(measured, rel=1e-3), (i, measured, predicted)
        x = {k: (v.detach() if torch.is_tensor(v) else v) for k, v in out.items()}


# ------------------------------------------------------------ the estimate
def config_file(tmp_path, **extra):
    data = {
        "model_type": "qwen3",
        "vocab_size": 1000,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1 << 20,
        **extra,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


def run_cli(*args):
    import io

    out = io.StringIO()
    code = main(["estimate", *map(str, args)], out=out)
    return code, out.getvalue()


def test_probe_products_in_fp32_reuse_a_parameters_copy_until_it_changes():
    """_Fp32Matmuls computes bf16 CPU products in fp32 and rounds them back:
    a parameter's fp32 copy is made once and reused (a linear's weight
    reaches the product as a transposed view of it), made again after the
    parameter changes, and dropped with the parameter."""
    import gc
    import weakref

    lin = torch.nn.Linear(48, 80).bfloat16()
    x = torch.randn(5, 48, dtype=torch.bfloat16, requires_grad=True)

    def expected(lin):
        return (x.float() @ lin.weight.float().t() + lin.bias.float()).bfloat16()

    with _Fp32Matmuls():
        first = lin(x)
        kept = _Fp32Matmuls._weights[lin.weight][1]
        first.sum().backward()  # the input's gradient: the weight untransposed
        again = lin(x)
    assert _Fp32Matmuls._weights[lin.weight][1] is kept
    assert torch.equal(first, expected(lin)) and torch.equal(again, expected(lin))
    torch.testing.assert_close(x.grad, lin.weight.float().sum(0).bfloat16().expand(5, 48))
    with torch.no_grad():
        lin.weight.mul_(-2)
    with _Fp32Matmuls():
        changed = lin(x)
    assert _Fp32Matmuls._weights[lin.weight][1] is not kept
    assert torch.equal(changed, expected(lin))
    copy = weakref.ref(_Fp32Matmuls._weights[lin.weight][1])
    del lin, first, again, changed, kept
    gc.collect()
    assert copy() is None  # (other tests' parameters may still have theirs)


def test_probe_products_find_a_parameters_copy_through_a_saved_view(monkeypatch):
    """A weight that autograd saved while the probes count saved bytes (a
    saved-tensor hook) comes back in the backward as a view of the weight's
    storage, not of the parameter object: its fp32 copy is still the
    parameter's, not converted again (each backward converted a block's
    weights again)."""
    from lightning_roundpipe.runtime.profiler import saved_bytes

    lin = torch.nn.Linear(48, 80).bfloat16()
    x = torch.randn(5, 48, dtype=torch.bfloat16, requires_grad=True)
    converted = []
    float_ = torch.Tensor.float

    def counting(t, *args, **kwargs):
        converted.append(tuple(t.shape))
        return float_(t, *args, **kwargs)

    with saved_bytes(lin, {}, 0), _Fp32Matmuls():
        y = lin(x)
        kept = _Fp32Matmuls._weights[lin.weight][1]
    with _Fp32Matmuls():
        monkeypatch.setattr(torch.Tensor, "float", counting)
        y.sum().backward(inputs=[x])
    monkeypatch.undo()
    assert (80, 48) not in converted and (48, 80) not in converted, converted
    assert _Fp32Matmuls._weights[lin.weight][1] is kept
    expected = lin.weight.float().sum(0).bfloat16().expand(5, 48)
    torch.testing.assert_close(x.grad, expected)


def test_probe_products_keep_a_parameters_copy_across_a_parametrization():
    """Registering a parametrization sets the parameter to itself (a new
    version, the same values; PEFT's LoRA on expert weights does it at
    every forward): its fp32 copy stays; a real change still replaces it."""
    lin = torch.nn.Linear(48, 80).bfloat16()
    x = torch.randn(5, 48, dtype=torch.bfloat16)
    with _Fp32Matmuls():
        lin(x)
        kept = _Fp32Matmuls._weights[lin.weight][1]
        torch.nn.utils.parametrize.register_parametrization(lin, "weight", torch.nn.Identity())
        torch.nn.utils.parametrize.remove_parametrizations(lin, "weight")
        lin(x)
        assert _Fp32Matmuls._weights[lin.weight][1] is kept
        with torch.no_grad():
            lin.weight.set_(lin.weight * 2)
        changed = lin(x)
    assert _Fp32Matmuls._weights[lin.weight][1] is not kept
    assert torch.equal(changed, (x.float() @ lin.weight.float().t() + lin.bias.float()).bfloat16())


def test_probe_backwards_allocate_weight_gradients_without_computing_them():
    """In a backward, a product larger than each of its operands (a weight's
    gradient at the probes' lengths) is allocated with its shape, dtype and
    strides and not computed; the input's gradient is computed; forward
    products are computed."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):  # (entered first: sees what reaches the kernels)
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
                self.seen.append(func)  # (not the shapes worked out on the meta device)
            return func(*args, **(kwargs or {}))

    w = torch.nn.Parameter(torch.randn(80, 48, dtype=torch.bfloat16))
    x = torch.randn(5, 48, dtype=torch.bfloat16, requires_grad=True)
    with Ops() as ops, _Fp32Matmuls():
        y = x @ w.t()
        forward = ops.seen.count(torch.ops.aten.mm.default)
        gx, gw = torch.autograd.grad(y.sum(), [x, w])
    assert forward == 1
    assert ops.seen.count(torch.ops.aten.mm.default) == 2  # and the input's gradient only
    assert torch.ops.aten.empty_strided.default in ops.seen
    assert gw.shape == w.shape and gw.dtype == w.dtype
    # a forward's product under no_grad is read (a rotary table): computed
    inv, pos = torch.rand(4, 1), torch.arange(6.0)[None]
    with _Fp32Matmuls(), torch.no_grad():
        table = inv @ pos
    torch.testing.assert_close(table, inv * pos)
    torch.testing.assert_close(gx, w.float().sum(0).bfloat16().expand(5, 48))


@pytest.mark.parametrize("lora", [None, 4], ids=["full", "lora"])
def test_probes_that_skip_unread_gradient_values_count_the_same_bytes(monkeypatch, lora):
    """The probes' shortcuts (weight gradients allocated, not computed; a
    tiled backward's parameter gradients neither zeroed nor added) change
    no byte they count: a tiled Mixture-of-Experts model's activation model
    is the one the full computation gives, in bf16 and fp32."""
    from transformers import AutoConfig

    from lightning_roundpipe.models import estimate as est
    from lightning_roundpipe.models.memory import _LiveBytes

    config = AutoConfig.for_model(
        model_type="mixtral",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
        num_local_experts=4,
        num_experts_per_tok=2,
    )

    def probed(dtype, tiles):
        adapter = est.hf_adapter(est._meta_model(config, lora), "model")
        torch.manual_seed(0)
        return adapter.activation_model(dtype, tiles, loss=True, prepare=est.materialiser(dtype))

    cases = [(d, t) for d in (torch.bfloat16, torch.float32) for t in ({}, {"mlp_tile": 50})]
    quick = [probed(*case) for case in cases]
    monkeypatch.setattr(_Fp32Matmuls, "_weight_gradient", staticmethod(lambda *a: None))
    monkeypatch.setattr(_LiveBytes, "bytes_only", False)
    assert quick == [probed(*case) for case in cases]


def test_random_values_for_the_probes_are_finite_of_a_weights_scale_and_reproducible():
    from lightning_roundpipe.models.estimate import _fill_random

    big = torch.empty(700, 4096, dtype=torch.bfloat16)  # past the drawn run
    _fill_random(big, torch.Generator().manual_seed(0))
    assert torch.isfinite(big).all()
    assert abs(big.float().std().item() - 0.02) < 1e-3 and abs(big.float().mean()) < 1e-3
    assert len({tuple(row.tolist()) for row in big[:, :8]}) == 700  # no row repeats another
    again = torch.empty_like(big)
    _fill_random(again, torch.Generator().manual_seed(0))
    assert torch.equal(big, again)
    small = torch.empty(3, 5).t()  # not contiguous: drawn directly
    _fill_random(small, torch.Generator().manual_seed(0))
    assert torch.isfinite(small).all() and small.std() > 0


def test_estimate_makes_stages_smaller_where_their_gradient_staging_would_not_fit(tmp_path):
    """Where the first plan's page-locked gradient staging would not fit the
    host the model state leaves, the plan starts with smaller stages, as the
    engine does: a short sequence fits, and needs no more host memory than a
    longer one (it needed more, and did not fit while a longer one did)."""
    from lightning_roundpipe.models.estimate import GiB, estimate, load_config

    config = load_config(str(config_file(tmp_path)))
    roomy = estimate(config, gpu_memory=1.25 * GiB, host_memory=64 * GiB, seq=16)
    state, staged = roomy.host["state"], roomy.host["staging"]
    assert staged > 0
    host = state + 0.75 * staged  # the first plan's staging does not fit
    short = estimate(config, gpu_memory=1.25 * GiB, host_memory=host, seq=16)
    assert short.plan != roomy.plan
    assert short.host["staging"] <= 0.75 * staged and short.host["total"] <= host
    assert short.longest_seq >= 64
    longer = estimate(config, gpu_memory=1.25 * GiB, host_memory=host, seq=64)
    assert longer.host["total"] >= short.host["total"]
    assert longer.host["total"] <= host


def test_estimate_prints_plan_memory_longest_sequence_and_throughput(tmp_path):
    path = config_file(tmp_path)
    code, text = run_cli(path, "--gpu-memory", 1.25, "--gpus", 2, "--host-memory", 4)
    assert code == 0, text
    for line in ("plan: ", "device memory per stage", "host memory: ", "fits: yes", "tokens/s"):
        assert line in text
    longest = int(text.split("longest sequence at micro-batch 1: ")[1].split()[0])
    assert longest > 1000
    # the longest sequence is the edge: it fits, one more quarter does not
    code, text = run_cli(path, "--gpu-memory", 1.25, "--seq", longest)
    assert "fits: yes" in text
    code, text = run_cli(path, "--gpu-memory", 1.25, "--seq", int(longest * 1.25))
    assert "fits: NO (a stage's predicted peak, " in text and "a stage may use)" in text
    assert "simulated step (as if it fitted): " in text
    # Trainer(precision=...)'s short names are accepted, as the help says
    assert run_cli(path, "--gpu-memory", 1.25, "--precision", "bf16")[0] == 0
    # LoRA: the base is frozen
    code, text = run_cli(path, "--gpu-memory", 1.25, "--lora-rank", 4, "--seq", 512)
    assert code == 0 and "trainable)" in text


@pytest.mark.parametrize(
    ("task", "width"),
    [("SequenceClassification", 1), ("TokenClassification", 1), ("QuestionAnswering", 2)],
)
def test_the_estimate_of_a_reward_models_config_builds_its_classifier(tmp_path, task, width):
    """A config whose architectures name a *ForSequenceClassification (a
    reward model's), *ForTokenClassification or *ForQuestionAnswering is
    estimated as that model: its head is the score, not the LM head (untied
    here: a vocabulary's worth of parameters fewer)."""
    lm = config_file(tmp_path, tie_word_embeddings=False)
    code, lm_text = run_cli(lm, "--gpu-memory", 1.25, "--seq", 256)
    assert code == 0, lm_text
    path = config_file(
        tmp_path,
        tie_word_embeddings=False,
        architectures=[f"Qwen3For{task}"],
        num_labels=1,
        pad_token_id=0,
    )
    code, text = run_cli(path, "--gpu-memory", 1.25, "--seq", 256)
    assert code == 0 and "fits: yes" in text, text
    assert f"(Qwen3For{task})" in text.splitlines()[0]

    def parameters(report: str) -> float:
        return float(report.split("B parameters")[0].split(", ")[-1]) * 1e9

    head = 1000 * 64 - width * (64 + (task == "QuestionAnswering"))  # (qa_outputs: a bias)
    assert parameters(lm_text) - parameters(text) == pytest.approx(head, abs=1e3)


@pytest.mark.parametrize(
    "family",
    [
        dict(model_type="phimoe", num_local_experts=4, num_experts_per_tok=2),
        dict(model_type="llama4_text", num_local_experts=4, intermediate_size_mlp=128),
        dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=2),
    ],
    ids=["phimoe", "llama4", "falcon"],
)
def test_the_lora_estimate_leaves_routers_that_return_tuples_alone(tmp_path, family):
    """PhiMoE's and Llama 4's routers subclass nn.Linear but return routing
    tuples, which a LoRA wrapper cannot add its update to: --lora-rank puts
    adapters on every other linear layer (the estimate used to fail there).
    Falcon's linear layers subclass nn.Linear too, returning tensors: they
    get adapters."""
    pytest.importorskip("peft")
    path = config_file(tmp_path, **family)
    if family["model_type"] == "falcon":  # (its head_dim is derived)
        data = json.loads(path.read_text())
        del data["head_dim"]
        path.write_text(json.dumps(data))
    code, text = run_cli(path, "--gpu-memory", 1.25, "--lora-rank", 4, "--seq", 256)
    assert code == 0 and "fits: yes" in text, text
    trainable = float(text.split("B parameters (")[1].split("B trainable")[0])
    assert 0 < trainable < 0.01


def test_the_lora_estimate_leaves_out_what_peft_refuses_in_mamba_models():
    """PEFT's "all-linear" refuses adapters on a Nemotron-H Mamba mixer's
    out_proj: the estimate asks PEFT's own check and leaves those out (it
    failed there); the attention's projections keep theirs."""
    peft = pytest.importorskip("peft")
    from lightning_roundpipe.models.estimate import _meta_model

    model = _meta_model(tiny("nemotron_h").config, lora_rank=4)
    wrapped = {n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert "model.layers.0.mixer.in_proj" in wrapped
    assert "model.layers.0.mixer.out_proj" not in wrapped
    assert {"model.layers.1.mixer.q_proj", "model.layers.1.mixer.o_proj"} <= wrapped


def test_the_estimate_builds_a_text_config_the_auto_mapping_lists_under_no_model_type():
    """Emu3's text config (``emu3_text_model``) is the config of the
    ``Emu3ForCausalLM`` the auto mapping lists under the multimodal ``emu3``:
    the estimate builds that class (it failed: AutoModelForCausalLM does not
    know the text config); the auto mapping still builds everything it knows."""
    from lightning_roundpipe.models.estimate import _causal_lm_class, _meta_model

    text = tiny("emu3_text_model").config
    model = _meta_model(text, lora_rank=None)
    assert type(model).__name__ == "Emu3ForCausalLM"
    assert _causal_lm_class(tiny("llama").config) is transformers.AutoModelForCausalLM


def test_only_linear_layers_returning_something_else_than_a_tensor_lose_their_adapter():
    from lightning_roundpipe.models.estimate import _returns_a_tensor

    class Router(nn.Linear):
        def forward(self, x):
            return super().forward(x), x

    class Batched(nn.Linear):  # (wants batch x tokens x features)
        def forward(self, x):
            b, s, h = x.shape
            return super().forward(x.view(b * s, h)).view(b, s, -1)

    class Scaled(nn.Linear):  # (wants another argument: given the benefit of the doubt)
        def forward(self, x, scale):
            return super().forward(x) * scale

    class Grouped(nn.Linear):  # (DeepSeek-V4's: features in 2 groups, one weight block each)
        def forward(self, x):
            w = self.weight.view(2, -1, x.shape[-1]).transpose(1, 2)
            y = torch.bmm(x.reshape(-1, 2, x.shape[-1]).transpose(0, 1), w).transpose(0, 1)
            return y.reshape(*x.shape[:-2], 2, -1)

    class Widening(nn.Linear):  # (a tensor, but not out_features per token)
        def forward(self, x):
            return super().forward(x).repeat(1, 1, 2)

    with torch.device("meta"):
        layers = [nn.Linear(4, 3), Router(4, 3), Batched(4, 3), Scaled(4, 3)]
        layers += [Grouped(4, 6), Widening(4, 3)]
    assert [_returns_a_tensor(m) for m in layers] == [True, False, True, True, False, False]


def gib_in(text: str, label: str) -> float:
    return float(text.split(label)[1].split(" GiB")[0])


def test_the_longest_sequence_respects_the_host_memory_and_says_what_bounds_it(tmp_path):
    """The boundary activations of a step live in host memory: with too little
    of it the longest sequence is shorter than the devices allow, and the
    estimate says the host is the bound (it still fits at that length)."""
    path = config_file(tmp_path)
    code, text = run_cli(path, "--gpu-memory", 1.25, "--gpus", 2)
    assert "(bounded by device memory)" in text
    device = int(text.split("longest sequence at micro-batch 1: ")[1].split()[0])
    state = gib_in(text, "(model state ")
    # room for a quarter of the device-bounded sequence's boundary activations
    code, text = run_cli(path, "--gpu-memory", 1.25, "--gpus", 2, "--seq", device)
    acts = gib_in(text, "boundary activations ")
    host = state + acts / 4
    code, text = run_cli(path, "--gpu-memory", 1.25, "--gpus", 2, "--host-memory", host)
    assert code == 0, text
    assert "(bounded by host memory;" in text and "fits: yes" in text
    longest = int(text.split("longest sequence at micro-batch 1: ")[1].split()[0])
    assert 0 < longest < device
    # it says what the devices alone allow and the host memory that needs,
    # which then bounds the sequence no more (the report rounds to 0.01 GiB)
    alone = text.split("the GPUs alone allow ")[1]
    assert int(alone.split()[0]) == device
    needed = gib_in(alone, "tokens, with ")
    assert host < needed
    code, text = run_cli(path, "--gpu-memory", 1.25, "--gpus", 2, "--host-memory", needed + 0.01)
    assert "(bounded by device memory)" in text and "fits: yes" in text
    assert int(text.split("longest sequence at micro-batch 1: ")[1].split()[0]) == device
    # the edge again, now of the host: it fits, one more quarter does not
    args = (path, "--gpu-memory", 1.25, "--gpus", 2, "--host-memory", host)
    assert "fits: yes" in run_cli(*args, "--seq", longest)[1]
    assert "fits: NO" in run_cli(*args, "--seq", int(longest * 1.25))[1]
    # less host memory than the model state: nothing fits, whatever the plan
    # the plan and step are then shown where the GPUs alone would put them
    # (a stage within its share of the GPU), not at one token
    code, text = run_cli(path, "--gpu-memory", 1.25, "--host-memory", state / 2)
    assert "longest sequence at micro-batch 1: 0 tokens" in text and "fits: NO" in text
    assert "; LoRA adapters (--lora-rank) keep optimizer state for far fewer weights" in text
    alone = int(text.split("the GPUs alone allow ")[1].split()[0])
    assert f"setting: 1 x {alone} tokens per micro-batch" in text
    assert f"note: the plan, memory and step above are at {alone} tokens, the longest" in text
    limit = gib_in(text, "a stage may use ")
    peaks = text.split("(predicted peak): ")[1].splitlines()[0].split(", ")
    assert max(float(p.split()[0]) for p in peaks) <= limit + 0.005
    # at the longest sequences a stage takes all of the GPU's usable memory,
    # and where the host holds few boundary values the stages are rewalked:
    # it says so, with the compute that costs
    args = (path, "--gpu-memory", 1.25, "--gpus", 2, "--host-memory", state + acts / 8)
    code, text = run_cli(*args)
    assert "a stage may use 0.22 GiB of each (all of its usable memory: nothing prefetched" in text
    assert text.split("plan: ")[1].split()[0].endswith("|rewalk")
    assert "note: rewalked plan: its backward stages recompute one layer at a time" in text
    assert "(forwards of the layers below: " in text and "% more compute)" in text
    # and the step counts the copies nothing hides then: the weights, the
    # inputs and gradients, the rewalk's uploads of a stage's input again
    wait = float(text.split("the GPUs wait ")[1].split()[0])
    assert wait > 0 and "s in all for copies compute does not hide" in text
    args_text = text
    # prefetched, only gradients that outlast a recompute could wait: far
    # less per token
    text = run_cli(path, "--gpu-memory", 1.25, "--gpus", 2, "--seq", 1024)[1]
    assert "nothing prefetched" not in text and "rewalk" not in text
    short = float(text.split("the GPUs wait ")[1].split()[0]) if "GPUs wait" in text else 0.0
    longest_tokens = int(args_text.split("setting: 1 x ")[1].split()[0])
    assert short / 1024 < wait / longest_tokens


def test_a_frozen_base_in_the_compute_dtype_is_held_once_on_the_host(tmp_path):
    """LoRA on a base loaded in fp32 keeps it twice on the host (the parameters
    and the bf16 master copy); loaded in bf16 the parameters are the master
    copy: the estimate says so, and the host-bounded sequence grows."""
    pytest.importorskip("peft")
    path = config_file(tmp_path, vocab_size=64000, hidden_size=512, head_dim=128)
    args = (path, "--gpu-memory", 1.25, "--gpus", 2, "--lora-rank", 4)
    code, text = run_cli(*args)
    assert code == 0, text
    # (named after its folder, not the dtype of the note)
    assert text.startswith(f"model: {path.parent.name}, "), text
    fp32 = gib_in(text, "(model state ")
    note = text.split("are their own master copy: host state ")[1]
    assert gib_in("x" + note, "x") < fp32
    text = run_cli(*args, "--frozen-dtype", "bfloat16")[1]
    bf16 = gib_in(text, "(model state ")
    assert bf16 == gib_in("x" + note, "x") and "own master copy" not in text
    # 2 bytes per frozen parameter instead of 4 + 2: about a third
    assert 0.3 < bf16 / fp32 < 0.4
    device = int(text.split("longest sequence at micro-batch 1: ")[1].split()[0])
    acts = gib_in(run_cli(*args, "--seq", device)[1], "boundary activations ")
    host = fp32 + acts / 2  # bounds the fp32 base; the bf16 one has room to spare
    longest = {}
    for dtype, bound in (("float32", "host"), ("bfloat16", "device")):
        text = run_cli(*args, "--host-memory", host, "--frozen-dtype", dtype)[1]
        assert f"(bounded by {bound} memory" in text
        longest[dtype] = int(text.split("longest sequence at micro-batch 1: ")[1].split()[0])
    assert longest["float32"] < longest["bfloat16"] == device
    # a host smaller than the fp32 base's state: said first, and nothing else
    # about the host's share of boundary values
    text = run_cli(*args, "--host-memory", 0.9 * fp32)[1]
    notes = [line for line in text.splitlines() if line.startswith("note: ")]
    assert notes[0].startswith("note: the model state alone (") and "no sequence fits" in notes[0]
    assert "frozen weights in the compute dtype need less" in notes[0]
    assert "fits: NO" in text and "rounds of" not in text


def test_a_gpu_too_small_for_a_layers_weights_is_refused_naming_the_gpu_memory(tmp_path, capsys):
    """A layer whose weights and gradients alone exceed a stage's share of the
    GPU is refused at once (no probes), with the GPU memory that would hold
    it, which then does."""
    path = config_file(tmp_path, vocab_size=64000, hidden_size=512, head_dim=128)
    code, _ = run_cli(path, "--gpu-memory", 1.1)
    err = capsys.readouterr().err
    assert code == 2, err
    assert (
        "of device memory for its weights and gradients alone, more than a stage may use on a "
        in err
    )
    assert "gpu_memory (--gpu-memory) must be at least " in err
    assert "or train LoRA adapters (--lora-rank)" in err
    need = float(err.split("must be at least ")[1].split(" GiB")[0])
    code, text = run_cli(path, "--gpu-memory", need + 0.01, "--seq", 16)
    assert code == 0 and "fits: yes" in text, text


def test_estimate_refuses_what_it_cannot_read(tmp_path, capsys):
    code, _ = run_cli(tmp_path / "missing-model", "--gpu-memory", 24)
    assert code == 2
    assert "neither a config JSON file nor a model whose config is in the local" in (
        capsys.readouterr().err
    )
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    code, _ = run_cli(bad, "--gpu-memory", 24)
    assert code == 2 and "a config JSON needs 'model_type'" in capsys.readouterr().err


def test_estimate_says_what_is_wrong_with_a_config_directory_or_type(tmp_path, capsys):
    """A directory without config.json, or with a broken one, and a model
    type transformers does not know: each says so in a line, naming the
    file (not transformers' "Unrecognized model" or its list of 800 types)."""
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _ = run_cli(empty, "--gpu-memory", 24)
    err = capsys.readouterr().err
    assert code == 2 and f"error: {empty}: a directory without config.json" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama",')
    code, _ = run_cli(broken, "--gpu-memory", 24)
    err = capsys.readouterr().err
    assert code == 2 and f"{broken / 'config.json'}: not a config JSON file (Expecting" in err
    typo = config_file(tmp_path, model_type="qwen-3")
    code, _ = run_cli(typo, "--gpu-memory", 24)
    err = capsys.readouterr().err
    assert code == 2 and len(err) < 400, err
    assert f"{typo}: model_type 'qwen-3' is not one transformers " in err
    assert "did you mean 'qwen3'" in err
    config_file(tmp_path, model_type="nothing-like-any")
    code, _ = run_cli(tmp_path, "--gpu-memory", 24)  # (the directory holding it)
    err = capsys.readouterr().err
    assert code == 2 and "model_type 'nothing-like-any' is not one" in err
    assert "did you mean" not in err and len(err) < 400


def test_estimate_warns_about_sizes_a_config_leaves_to_transformers_defaults(
    tmp_path, capsys, caplog
):
    """A deciding size missing from the file (or misspelt) takes
    transformers' default for the model type, and a warning names it and
    its value; names a config class maps (GPT-2's n_embd) count as given."""
    path = config_file(tmp_path, hidden_sise=64)
    data = json.loads(path.read_text())
    del data["hidden_size"], data["num_key_value_heads"]
    path.write_text(json.dumps(data))
    code, _ = run_cli(path, "--gpu-memory", 24, "--seq", 16)
    err = capsys.readouterr().err
    assert (
        f"warning: {path} leaves out hidden_size, num_key_value_heads: the estimate uses "
        "transformers' defaults for 'qwen3' (hidden_size=4096, num_key_value_heads=32)\n"
    ) in err
    # (the default is what the check then refuses: said after the warning)
    assert code == 2 and err.index("warning: ") < err.index(
        f"error: {path}: num_attention_heads (4) must be a multiple of num_key_value_heads (32)"
    )
    data["num_attention_heads"] = 32
    path.write_text(json.dumps(data))
    code, text = run_cli(path, "--gpu-memory", 24, "--seq", 16)
    err = capsys.readouterr().err
    assert code == 0 and "leaves out hidden_size, num_key_value_heads" in err
    assert "model: " in text
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_embd": 64,
                "n_layer": 2,
                "n_head": 4,
                "n_positions": 256,
                "vocab_size": 300,
            }
        )
    )
    from lightning_roundpipe.models.estimate import load_config

    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_roundpipe.models.estimate"):
        load_config(str(gpt2))
    assert caplog.text == ""


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"hidden_size": -64}, "hidden_size must be a positive integer, got -64"),
        ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer, got 0"),
        ({"vocab_size": 0}, "vocab_size must be a positive integer, got 0"),
        # transformers' own validation, as an error line naming the file
        ({"head_dim": None}, "Validation error for field 'head_dim'"),
        # the model's own checks while it is built (was a traceback)
        ({"pad_token_id": 1000}, "cannot be built from this config: AssertionError: Padding_idx"),
        # key-value heads that do not divide the heads failed in the first
        # probe's forward pass (was a traceback)
        (
            {"num_key_value_heads": 3},
            "num_attention_heads (4) must be a multiple of num_key_value_heads (3)",
        ),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
        ({"intermediate_size": -5}, "intermediate_size must be a positive integer, got -5"),
        ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
        ({"head_dim": -8}, "head_dim must be a positive integer, got -8"),
        # no limit would be searched past it (and a note said it was none)
        (
            {"max_position_embeddings": 0},
            "max_position_embeddings must be a positive integer, got 0",
        ),
        (
            {"max_position_embeddings": -1},
            "max_position_embeddings must be a positive integer, got -1",
        ),
    ],
)
def test_estimate_refuses_config_sizes_that_make_no_model(tmp_path, capsys, extra, expected):
    path = config_file(tmp_path, **extra)
    code, _ = run_cli(path, "--gpu-memory", 24)
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: {path}: ") and expected in err, err


def test_a_host_too_small_for_the_model_state_is_blamed_alone(tmp_path):
    """No plan fits a host smaller than the model state: the plan shown is
    the one the GPUs would run (not one squeezed for an impossible host
    limit, with stages over the device), and only the host is named."""
    path = config_file(tmp_path, num_hidden_layers=8)
    args = (path, "--gpu-memory", 1.25, "--seq", 20000)
    code, alone = run_cli(*args)
    assert code == 0, alone
    code, text = run_cli(*args, "--host-memory", 0.005)
    assert code == 0, text

    def line(out, start):
        return next(x for x in out.splitlines() if x.startswith(start))

    assert line(text, "plan: ") == line(alone, "plan: ")
    assert line(text, "fits: ").startswith("fits: NO (host memory "), text
    assert "predicted peak" not in line(text, "fits: ")


def test_a_model_that_fails_on_the_probes_is_refused_naming_the_config_file(
    tmp_path, capsys, monkeypatch
):
    """A config the checks let through but whose model fails in its first
    forward pass (here key-value heads that do not divide the heads, the
    check bypassed) is refused as a model that cannot be built from the
    file, with the model's own error (was a traceback); an interrupt still
    interrupts."""
    from lightning_roundpipe.models import causal_lm, estimate

    monkeypatch.setattr(estimate, "_check_sizes", lambda config, source: None)
    path = config_file(tmp_path, num_key_value_heads=3)
    code, _ = run_cli(path, "--gpu-memory", 24)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(
        f"error: {path}: Qwen3ForCausalLM cannot be built from this config: its layers fail on "
        "a short probe input: RuntimeError: The size of tensor a (4) must match"
    ), err

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(causal_lm, "probe_activations", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_cli(config_file(tmp_path), "--gpu-memory", 24)


def test_estimate_says_when_the_config_gives_no_position_limit(tmp_path):
    """A config with no max_position_embeddings (Mamba's): the longest
    sequence is searched past the million tokens the plan is shown at, and
    the note says both, as the report's lines do."""
    path = tmp_path / "mamba.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "mamba",
                "vocab_size": 1000,
                "hidden_size": 32,
                "num_hidden_layers": 2,
                "state_size": 4,
                "expand": 2,
            }
        )
    )
    code, text = run_cli(path, "--gpu-memory", 80)
    assert code == 0, text
    assert "setting: 1 x 1048576 tokens per micro-batch" in text
    longest = int(text.split("longest sequence at micro-batch 1: ")[1].split()[0])
    assert longest > 1048576
    assert (
        "note: the config gives no max_position_embeddings: the longest sequence is searched "
        "up to 4194304 tokens, and the plan, memory and step above are shown at 1048576 tokens"
    ) in text
    assert "past max_position_embeddings" not in text and "search stopped" not in text
    # a sequence given: the setting is that, and the note says nothing of it
    code, text = run_cli(path, "--gpu-memory", 80, "--seq", 4096)
    assert code == 0 and "setting: 1 x 4096 tokens per micro-batch" in text, text
    assert (
        "note: the config gives no max_position_embeddings: the longest sequence is searched "
        "up to 4194304 tokens\n"
    ) in text


def test_a_frozen_dtype_without_lora_is_refused_naming_both_flags(tmp_path, capsys):
    """Without LoRA adapters every weight is trained: a dtype for frozen
    weights would change nothing, so it is refused (it was silently ignored)."""
    path = config_file(tmp_path)
    code, _ = run_cli(path, "--gpu-memory", 24, "--frozen-dtype", "bfloat16")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "frozen_dtype (--frozen-dtype) is the dtype of the frozen base under LoRA" in err
    assert "needs lora_rank (--lora-rank): without adapters every weight is trained" in err
    from lightning_roundpipe.models.estimate import estimate

    with pytest.raises(ValueError, match=r"frozen_dtype \(--frozen-dtype\) .* needs lora_rank"):
        estimate(object(), gpu_memory=24 * 2**30, frozen_dtype=torch.bfloat16)


def test_estimate_prints_the_gradient_all_reduce_across_servers(tmp_path, capsys):
    path = config_file(tmp_path)
    args = (path, "--gpu-memory", 1.25, "--gpus", 2, "--seq", 256)
    code, text = run_cli(*args, "--servers", 2, "--network-gbps", 1)
    assert code == 0, text
    assert "servers: 2 replicas on a 1 Gb/s network" in text
    assert "gradients all-reduced per step: " in text and "sent by each server" in text
    assert "all-reduce: link busy " in text and "(asynchronous optimizer" in text
    one = float(text.split("simulated step: ")[1].split(", ")[1].split()[0])
    both = float(text.split("throughput of 2 servers: ")[1].split()[0])
    assert 0 < both < 2 * one  # the exposed all-reduce costs throughput
    # a tiny model's step takes microseconds: no overlap hides a 1 Gb/s link
    assert "network: the network is the bottleneck" in text and "fewer servers" in text
    code, text = run_cli(*args, "--servers", 2, "--sync")
    assert code == 0 and "(synchronous optimizer" in text
    code, text = run_cli(*args, "--servers", 1)
    assert code == 0
    for line in ("servers:", "all-reduce:", "throughput of", "network:"):
        assert line not in text
    # options are checked before the model is read (test_estimate_refuses_bad_numbers)
    with pytest.raises(SystemExit):
        run_cli(path, "--gpu-memory", 1.25, "--servers", 0)
    assert "argument --servers: must be an integer > 0, got '0'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--tflops", "0", "a finite number > 0, got '0'"),
        ("--tflops", "-1", "a finite number > 0, got '-1'"),
        ("--link-gbps", "nan", "a finite number > 0, got 'nan'"),
        ("--network-gbps", "0", "a finite number > 0, got '0'"),
        ("--gpu-memory", "inf", "a finite number > 0, got 'inf'"),
        ("--host-memory", "inf", "a finite number > 0, got 'inf'"),
        ("--seq", "0", "an integer > 0, got '0'"),
        ("--seq", "-5", "an integer > 0, got '-5'"),
        ("--microbatches", "0", "an integer > 0, got '0'"),
        ("--lora-rank", "0", "an integer > 0, got '0'"),
        ("--gpus", "2.5", "an integer > 0, got '2.5'"),
        ("--gpu-memory", "-5", "a finite number > 0, got '-5'"),
    ],
)
def test_estimate_refuses_bad_numbers_naming_the_flag(tmp_path, capsys, flag, value, expected):
    """Counts and rates are checked as arguments are read: the error names
    the flag (not the object it would have reached), and nothing runs."""
    args = [config_file(tmp_path), "--gpu-memory", 24, flag, value]
    with pytest.raises(SystemExit) as exc:
        run_cli(*args)
    assert exc.value.code == 2
    assert f"argument {flag}: must be {expected}" in capsys.readouterr().err


def test_estimate_errors_name_the_gpu_memory_and_the_config_file(tmp_path, capsys):
    path = config_file(tmp_path)
    code, _ = run_cli(path, "--gpu-memory", 0.5)
    assert code == 2
    assert (
        "gpu_memory (--gpu-memory) must be more than the 1.00 GiB the CUDA context takes, got "
        "0.50 GiB" in capsys.readouterr().err
    )
    path.write_text("not json")
    code, _ = run_cli(path, "--gpu-memory", 24)
    assert code == 2 and f"{path}: not a config JSON file (" in capsys.readouterr().err
    # and through the Python API, with the argument's own name
    from lightning_roundpipe.models.estimate import estimate

    with pytest.raises(ValueError, match="tflops must be > 0, got 0"):
        estimate(object(), gpu_memory=24 * 2**30, tflops=0)
    with pytest.raises(ValueError, match="seq must be an integer >= 1, got 0"):
        estimate(object(), gpu_memory=24 * 2**30, seq=0)
    # a model type with no causal LM at all (encoder-decoder): our message, not
    # transformers' list of every causal LM config class
    (tmp_path / "t5").mkdir()
    t5 = tmp_path / "t5" / "config.json"
    t5.write_text(json.dumps({"model_type": "t5", "d_model": 64, "num_layers": 2}))
    code, _ = run_cli(t5, "--gpu-memory", 24)
    err = capsys.readouterr().err
    assert code == 2 and "model_type 't5' has no causal language model" in err
    assert "decoder-only causal LMs (supported: " in err and "families, e.g. Llama" in err
    # a rank past the model's width is refused at once (building such adapters
    # took minutes and gigabytes before anything was said)
    (tmp_path / "good").mkdir()
    code, _ = run_cli(config_file(tmp_path / "good"), "--gpu-memory", 24, "--lora-rank", 100000)
    assert code == 2
    assert "lora_rank 100000 is larger than the model's hidden_size" in capsys.readouterr().err


def test_the_host_state_counts_the_asynchronous_optimizers_second_master_copy(tmp_path):
    """Full fine-tuning in bf16: 20 bytes per parameter with the asynchronous
    optimizer (two master copies), 18 with the synchronous one; a frozen
    parameter has one master copy either way."""
    from torch import nn

    from lightning_roundpipe.models.estimate import host_state_bytes

    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 3))
    model[1].requires_grad_(False)
    trained, frozen = 110, 33
    assert host_state_bytes(model, "bf16-mixed") == trained * 20 + frozen * 6
    assert host_state_bytes(model, "bf16-mixed", double_buffer=False) == trained * 18 + frozen * 6
    # and the estimate uses it as the engine would: with the asynchronous
    # optimizer unless told otherwise (``plan estimate --sync``)
    from lightning_roundpipe.models.estimate import estimate, load_config

    config = load_config(str(config_file(tmp_path)))
    two, one = (
        estimate(config, gpu_memory=1.25 * 2**30, seq=64, async_optimizer=a).host["state"]
        for a in (True, False)
    )
    assert two / one == pytest.approx(20 / 18, rel=1e-9)


def test_gradient_staging_is_one_power_of_two_block_per_size_class_and_gpu():
    """Each download of a stage's fp32 gradients takes a block of torch's
    caching host allocator, rounded up to a power of two and kept: on an
    H200 the fused Qwen3-1.7B stage's 8,126,959,616 bytes took an 8 GiB
    block. A GPU's worker holds about one block of each class its stages
    use, never more than there are such stages."""
    from lightning_roundpipe.runtime.host import staging_bytes

    assert staging_bytes([8_126_959_616], 1) == 2**33
    assert staging_bytes([8_126_959_616], 4) == 2**33  # one stage: one download at a time
    mib = 2**20
    assert staging_bytes([300 * mib, 290 * mib, 100 * mib, 0], 2) == 2 * 512 * mib + 128 * mib
    assert staging_bytes([300 * mib, 290 * mib, 100 * mib], 1) == 512 * mib + 128 * mib
    assert staging_bytes([], 8) == 0


def test_the_estimates_host_memory_counts_the_gradient_staging(tmp_path):
    """Full fine-tuning whose weights fit one GPU: one fused stage, whose fp32
    gradients come down into one page-locked block, the next power of two
    of 4 bytes per trainable parameter; part of the host total and of the
    report. LoRA's few trainable weights take a small block."""
    from lightning_roundpipe.models.estimate import estimate, load_config

    config = load_config(str(config_file(tmp_path)))
    full = estimate(config, gpu_memory=8 * 2**30, seq=64)
    assert full.plan.startswith("|") and full.plan.count("|") == 2  # fused only
    assert full.host["staging"] == 1 << (4 * full.trainable - 1).bit_length()
    assert full.host["total"] == pytest.approx(
        full.host["state"] + full.host["activations"] + full.host["staging"]
    )
    assert "page-locked gradient staging" in full.report()
    lora = estimate(config, gpu_memory=8 * 2**30, seq=64, lora_rank=4)
    assert 0 < lora.host["staging"] < full.host["staging"] / 10


def test_the_estimates_longest_sequence_leaves_room_for_the_gradient_staging(tmp_path):
    """The longest sequence is searched with the host memory the model state
    and the plan's gradient staging leave, as the report's total counts
    them: whatever length it names fits; a host that holds the state but
    not the staging fits nothing, and a note says why."""
    from lightning_roundpipe.models.estimate import estimate, load_config

    config = load_config(str(config_file(tmp_path)))
    kw = dict(gpu_memory=8 * 2**30)
    full = estimate(config, seq=64, **kw)
    state, staged = full.host["state"], full.host["staging"]
    assert staged > 0
    short = estimate(config, host_memory=state + staged / 2, **kw)
    assert short.longest_seq == 0 and not short.fits
    assert "and the page-locked staging of the gradient downloads" in short.notes[0]
    assert "no sequence fits" in short.notes[0]
    # and with room to spare, every length named fits at that length
    small = load_config(str(config_file(tmp_path, vocab_size=64000, hidden_size=512)))
    base = estimate(small, seq=64, **kw)
    for extra in (1.05, 4.0):
        host_memory = base.host["state"] + extra * base.host["staging"]
        named = estimate(small, host_memory=host_memory, **kw)
        assert named.longest_seq > 0
        at = estimate(small, host_memory=host_memory, seq=named.longest_seq, **kw)
        assert at.fits, (extra, at.host, host_memory)
        if named.longest_bound == "host memory":
            # the host memory it names for what the GPUs alone allow is enough
            enough = estimate(small, host_memory=named.device_longest_host, **kw)
            assert enough.longest_seq >= named.device_longest_seq


def test_the_estimates_fit_is_monotone_in_the_sequence_with_little_host_memory(
    tmp_path, monkeypatch
):
    """The longest sequence is bisected, so whether a length fits must not
    come back once lost. With little host memory the plan the engine
    chooses within the room its first plan's gradient staging leaves may
    stage more gradients itself, leaving its boundary values too little (or
    no) room: that plan is passed over for one with fewer boundary values
    rather than the length declared too long, and the plan checked is the
    plan shown. On a fine grid every length up to the one named fits and
    none past it does."""
    from lightning_roundpipe.models import estimate as estimate_mod

    predicates = []

    def spy(fits, *args, **kwargs):
        predicates.append(fits)
        return longest_sequence(fits, *args, **kwargs)

    monkeypatch.setattr(estimate_mod, "longest_sequence", spy)
    extra = dict(vocab_size=64000, hidden_size=512, intermediate_size=1024, head_dim=128)
    config = estimate_mod.load_config(str(config_file(tmp_path, num_hidden_layers=6, **extra)))
    # about the model state and twice the first plan's gradient staging: the
    # host bounds the sequence, and some plans the devices prefer stage more
    # gradients than it leaves room for
    host_memory = 1.86 * 2**30
    named = estimate_mod.estimate(config, gpu_memory=1.5 * 2**30, host_memory=host_memory)
    state, staged = named.host["state"], named.host["staging"]
    assert state + staged < host_memory < state + 3 * staged
    assert named.longest_bound == "host memory" and named.longest_seq > 0
    fits = predicates[0]  # (the host-bounded search's: the first)
    top = 3 * named.longest_seq // 2
    grid = range(top // 200, top, top // 200)
    verdicts = [fits(s) for s in grid]
    lost = [s for s, ok in zip(grid, verdicts, strict=True) if not ok]
    assert not lost or all(not ok for s, ok in zip(grid, verdicts, strict=True) if s > lost[0]), (
        [s for s, ok in zip(grid, verdicts, strict=True) if ok and s > lost[0]][:5],
        lost[:5],
    )
    assert fits(named.longest_seq) and not fits(named.longest_seq + 1)
    assert all(fits(s) == (s <= named.longest_seq) for s in grid)


def test_the_estimated_step_is_no_shorter_than_each_links_weight_traffic(tmp_path):
    """Each round every stage's weights go up and its fp32 gradients come
    down, the stages spread over the GPUs' links: where that takes longer
    than the compute, it is the step (and a note says so); LoRA's frozen
    weights have no gradients to bring down."""
    from lightning_roundpipe.models.estimate import estimate, load_config

    config = load_config(str(config_file(tmp_path, vocab_size=64000, hidden_size=512)))
    kw = dict(gpu_memory=8 * 2**30, seq=64, optimizer_gbps=1e6)
    compute = estimate(config, link_gbps=1e6, **kw)  # an instant link
    assert compute.step_seconds == compute.device_seconds > compute.upload_seconds
    assert not any("weight traffic" in n for n in compute.notes)
    weights = compute.parameters * 2  # bf16
    for gpus in (1, 2):
        slow = estimate(config, link_gbps=1.0, gpus=gpus, **kw)
        assert slow.step_seconds == slow.upload_seconds > compute.step_seconds
        gradients = slow.trainable * 4  # fp32, down while the weights go up
        per_link = max(weights, gradients) / gpus / 1e9
        assert slow.upload_seconds == pytest.approx(per_link, rel=1e-6)
        assert any("weight traffic" in n and "bounds the step" in n for n in slow.notes)
        assert slow.tokens_per_second == pytest.approx(64 * gpus / slow.upload_seconds)
    pytest.importorskip("peft")
    lora = estimate(config, link_gbps=1.0, lora_rank=4, **kw)
    assert lora.upload_seconds == pytest.approx(weights / 1e9, rel=1e-2)  # (and the adapters)


def test_the_estimated_step_counts_the_hosts_work_per_update(tmp_path):
    """On one server the host's update (step, gradient check, weight copies)
    overlaps the devices' work with the asynchronous optimizer and follows it
    with the synchronous one; where it is longer, the estimate says the host
    bounds the step."""
    from lightning_roundpipe.models.estimate import estimate, load_config

    config = load_config(str(config_file(tmp_path)))
    kw = dict(gpu_memory=1.25 * 2**30, seq=64)
    fast = estimate(config, optimizer_gbps=1e6, **kw)  # a very fast host
    assert fast.host_update_seconds < fast.device_seconds == fast.step_seconds
    assert not any("bound by the host" in n for n in fast.notes)
    assert "the host's " in fast.report() and "overlap the devices'" in fast.report()
    slow = estimate(config, optimizer_gbps=1e-4, **kw)  # a very slow host
    assert slow.host_update_seconds > slow.device_seconds
    assert slow.step_seconds == slow.host_update_seconds
    assert any("the step is bound by the host" in n for n in slow.notes)
    bf16 = 16 + 8 + 2  # step, gradient check and weight copy, bf16 write
    assert slow.host_update_seconds == pytest.approx(slow.trainable * bf16 / 1e5)
    sync = estimate(config, optimizer_gbps=1e-4, async_optimizer=False, **kw)
    assert sync.step_seconds == pytest.approx(sync.device_seconds + sync.host_update_seconds)
    assert "follow the devices'" in sync.report()
    assert slow.tokens_per_second == pytest.approx(64 * slow.num_microbatches / slow.step_seconds)
