"""The Hugging Face adapter on an engine: decoder stages never wait for the
device, build the mask and rotary tables once per stage, micro-batch and kind,
and train exactly like the unsplit model (padding and packed sequences
included); call arguments it does not implement are refused;
``logits_to_keep`` and ``inputs_embeds`` behave as in the model."""

import copy

import pytest
import torch
from test_adapters import attached  # the adapter on an engine of CPU workers
from torch import nn

from lightning_roundpipe.models import CausalLMAdapter
from lightning_roundpipe.models.layers import _Decoder
from lightning_roundpipe.runtime import RoundPipeEngine, WorkerError
from lightning_roundpipe.runtime.scope import HostSyncError, forbid_host_sync

transformers = pytest.importorskip("transformers")

PLAN = "2,3|1|3,2"  # F1 = embed + decoder 0, F2 = decoders 1-3, B2 = 1-3, B3 = embed + 0


VOCAB = 64
SEQ = 12


def qwen3(layers=4, **config):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attention_dropout=0.0,
        **config,
    )
    return transformers.Qwen3ForCausalLM(cfg)


def batches():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (4, 12), generator=g)
    padded = torch.ones(4, 12, dtype=torch.long)
    padded[1, 8:] = 0
    padded[3, 5:] = 0
    # two sequences per row: positions restart
    packed = torch.cat([torch.arange(7), torch.arange(5)]).expand(4, -1)
    return {
        "no mask": {"input_ids": ids, "labels": ids},
        "all-ones mask": {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids},
        "padding": {"input_ids": ids, "attention_mask": padded, "labels": ids},
        # with a cache (the config's default) the model treats these as one sequence
        "positions": {"input_ids": ids, "position_ids": packed, "labels": ids},
        "packed": {"input_ids": ids, "position_ids": packed, "labels": ids, "use_cache": False},
    }


def run(model, inputs, devices=("cpu", "cpu"), **engine_kw):
    adapter = CausalLMAdapter(model, "model")
    with RoundPipeEngine(adapter.layers(), list(devices), 2, plan=PLAN, **engine_kw) as eng:
        adapter.attach(eng)
        try:
            loss = model(**inputs).loss
            loss.backward()
            eng.synchronize()
        finally:
            adapter.detach()
    return loss.detach()


@pytest.mark.parametrize("case", list(batches()))
def test_decoder_stages_never_wait_for_the_device_and_match_the_model(case):
    inputs = batches()[case]
    model = qwen3()
    ref = copy.deepcopy(model)
    expected = ref(**inputs).loss
    expected.backward()
    loss = run(model, inputs, forbid_host_sync=True)
    torch.testing.assert_close(loss, expected.detach())
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["padding", "packed"])
def test_decoder_stages_on_a_gpu_never_synchronize(case):
    """On CUDA workers the guard also turns on CUDA's own check
    (``set_sync_debug_mode("error")``): any synchronizing call in a stage fails."""
    inputs = batches()[case]
    model = qwen3()
    ref = copy.deepcopy(model)
    expected = ref(**inputs).loss
    expected.backward()
    loss = run(model, inputs, devices=("cuda:0", "cuda:0"), forbid_host_sync=True)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-4, rtol=1e-4)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-3, msg=name)


def test_masks_and_rotary_tables_are_built_once_per_stage_and_microbatch(monkeypatch):
    calls = {"mask": 0, "rotary": 0}
    original = _Decoder._mask

    def mask(self, *args):
        calls["mask"] += 1
        return original(self, *args)

    monkeypatch.setattr(_Decoder, "_mask", mask)
    model = qwen3()
    rotary = model.model.rotary_emb
    forward = rotary.forward

    def count(*args, **kwargs):
        calls["rotary"] += 1
        return forward(*args, **kwargs)

    monkeypatch.setattr(rotary, "forward", count)
    run(model, batches()["padding"])
    # per micro-batch, four stages hold decoder layers (F1, F2 and the
    # recomputes of B2, B3); a layer-by-layer build would be 8 of each
    assert calls == {"mask": 4 * 2, "rotary": 4 * 2}
    # outside the pipeline every call builds its own
    calls.update(mask=0, rotary=0)
    layers = CausalLMAdapter(model, "m").layers()
    x = layers[0](
        batches()["padding"]["input_ids"], attention_mask=batches()["padding"]["attention_mask"]
    )
    for layer in layers[1:3]:
        x = layer(**x)
    assert calls == {"mask": 2, "rotary": 2}


class Syncs(nn.Module):
    def forward(self, x):
        if x.sum().item() > 1e9:  # a host sync inside a stage
            return x * 2
        return x


def test_the_guard_names_a_host_sync_inside_a_stage():
    layers = [nn.Linear(4, 4), Syncs(), nn.Linear(4, 1)]
    with (
        RoundPipeEngine(layers, ["cpu"] * 2, 2, forbid_host_sync=True) as eng,
        pytest.raises(WorkerError, match=r"HostSyncError: TensorBase\.item makes the host wait"),
    ):
        eng.forward_backward(
            torch.randn(4, 4), labels=torch.randn(4, 1), loss_fn=nn.functional.mse_loss
        )
    with forbid_host_sync(), pytest.raises(HostSyncError, match="bool"):
        bool(torch.ones(()) > 0)
    with forbid_host_sync(), pytest.raises(HostSyncError, match="__getitem__"):
        torch.ones(3)[torch.ones(3) > 0]


# ------------------------------------------------------------ calls
def test_call_arguments_the_pipeline_does_not_implement_are_refused():
    model = qwen3(layers=2)
    ids = torch.randint(0, VOCAB, (4, SEQ))

    def check(kwargs, error, match):
        with pytest.raises(error, match=match):
            attached(model, lambda: model(**kwargs))

    check({"input_ids": ids, "past_key_values": object()}, TypeError, "past_key_values is not")
    check(
        {"input_ids": ids, "output_hidden_states": True},
        TypeError,
        "output_hidden_states=True is not supported",
    )
    check(
        {"input_ids": ids, "attention_mask": torch.ones(4, 1, SEQ, SEQ)},
        TypeError,
        r"attention_mask must be a 2-D \(batch, sequence\) padding mask, got \(4, 1, 12, 12\)",
    )
    check(
        {"input_ids": ids, "position_ids": torch.arange(SEQ).expand(3, 4, SEQ)},
        TypeError,
        r"position_ids must be a \(sequence\) or \(batch or 1, sequence\) tensor, "
        r"got \(3, 4, 12\)",
    )
    check(
        {"input_ids": ids, "labels": ids, "logits_to_keep": 1},
        TypeError,
        "logits_to_keep=1 with labels= is not supported",
    )
    model.loss_function = lambda **kw: 0
    check({"input_ids": ids, "labels": ids}, ValueError, "the model's loss_function is")


def test_logits_to_keep_selects_the_models_logits():
    model = qwen3(layers=2).eval()
    ids = torch.randint(0, VOCAB, (4, SEQ))
    with torch.no_grad():
        for keep in (1, torch.tensor([0, 5])):
            expected = model(input_ids=ids, logits_to_keep=keep).logits
            got = attached(model, lambda keep=keep: model(input_ids=ids, logits_to_keep=keep))
            torch.testing.assert_close(got.logits, expected)


def test_logits_to_keep_without_transformers_slicing_helper(monkeypatch):
    """transformers < 5.21 has no ``slice_logits_to_keep``: its models sliced
    the positions themselves, as the adapter then does."""
    import transformers.modeling_utils as mu

    model = qwen3(layers=2).eval()  # (its module imports the helper)
    ids = torch.randint(0, VOCAB, (4, SEQ))
    keeps = (1, torch.tensor([0, 5]))
    with torch.no_grad():
        expected = [model(input_ids=ids, logits_to_keep=keep).logits for keep in keeps]
        monkeypatch.delattr(mu, "slice_logits_to_keep")
        for keep, want in zip(keeps, expected, strict=True):
            got = attached(model, lambda keep=keep: model(input_ids=ids, logits_to_keep=keep))
            torch.testing.assert_close(got.logits, want)


def test_a_transformers_older_than_the_adapter_needs_is_refused_at_import():
    import re
    import subprocess
    import sys
    from pathlib import Path

    from lightning_roundpipe.models import MIN_TRANSFORMERS, check_transformers

    with pytest.raises(
        ImportError,
        match=r"needs transformers>=5\.15\.0 .* but 5\.14\.1 is installed: "
        r"pip install -U 'transformers>=5\.15\.0'",
    ):
        check_transformers("5.14.1")
    check_transformers(MIN_TRANSFORMERS)
    check_transformers("6.0.0.dev0")
    check_transformers(None)  # not installed: other models still train
    # the package extra asks for the same version
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    floor = re.search(r'"transformers>=([\d.]+)"', pyproject).group(1)
    assert tuple(map(int, floor.split("."))) + (0,) * (3 - len(floor.split("."))) == tuple(
        map(int, MIN_TRANSFORMERS.split("."))
    )
    # the check runs when the package is imported
    code = (
        "import importlib.metadata as m; real = m.version\n"
        "m.version = lambda n: '5.3.0' if n == 'transformers' else real(n)\n"
        "import lightning_roundpipe"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "needs transformers>=5.15.0" in proc.stderr and "5.3.0 is installed" in proc.stderr


# ------------------------------------------------------------ inputs_embeds
def embed_case(padded: bool = True):
    g = torch.Generator().manual_seed(3)
    embeds = torch.randn(4, SEQ, 32, generator=g)
    labels = torch.randint(0, VOCAB, (4, SEQ), generator=g)
    mask = torch.ones(4, SEQ, dtype=torch.long)
    if padded:
        mask[1, 8:] = 0
        labels[1, 8:] = -100
    return embeds, mask, labels


def grads(model):
    return [
        torch.zeros_like(p) if p.grad is None else p.grad for p in model.parameters()
    ]  # the pipeline gives an unused weight (the embedding) a zero gradient


@pytest.mark.parametrize("loss_outside", [False, True])
def test_inputs_embeds_train_like_the_model(loss_outside):
    embeds, mask, labels = embed_case()
    positions = torch.arange(SEQ).expand(4, -1) + 2
    # sliding windows on every other layer
    model = qwen3(
        layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        use_sliding_window=True,
        sliding_window=5,
    )
    ref = copy.deepcopy(model)

    # a trainable soft prompt: the gradient flows back out of the pipeline
    soft_ref, soft = embeds.clone().requires_grad_(), embeds.clone().requires_grad_()

    def loss_of(m, e):
        if loss_outside:
            logits = m(inputs_embeds=e, attention_mask=mask, position_ids=positions).logits
            target = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        return m(inputs_embeds=e, attention_mask=mask, position_ids=positions, labels=labels).loss

    expected = 0.5 * loss_of(ref, soft_ref)
    expected.backward()

    def step():
        loss = 0.5 * loss_of(model, soft)
        loss.backward()
        return loss.detach()

    torch.testing.assert_close(attached(model, step), expected.detach())
    for a, b in zip(grads(model), grads(ref), strict=True):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(soft.grad, soft_ref.grad)


def test_inputs_embeds_evaluate_like_the_model_and_misuse_is_refused_as_by_the_model():
    embeds, mask, labels = embed_case()
    model = qwen3(layers=2).eval()
    with torch.no_grad():
        expected = model(inputs_embeds=embeds, attention_mask=mask, labels=labels)
        got = attached(
            model, lambda: model(inputs_embeds=embeds, attention_mask=mask, labels=labels)
        )
    torch.testing.assert_close(got.loss, expected.loss)
    torch.testing.assert_close(got.logits, expected.logits)

    model.train()
    ids = torch.randint(0, VOCAB, (4, SEQ))
    for kwargs in ({"input_ids": ids, "inputs_embeds": embeds}, {"attention_mask": mask}):
        with pytest.raises(ValueError) as theirs:
            model(**kwargs)
        with pytest.raises(ValueError) as ours:
            attached(model, lambda kwargs=kwargs: model(**kwargs))
        assert str(ours.value) == str(theirs.value)


def test_boundary_estimate_reads_inputs_embeds():
    adapter = CausalLMAdapter(qwen3(layers=2), "m")
    estimate = adapter.boundary_estimate(torch.bfloat16)
    embeds, mask, _ = embed_case()
    ids = torch.zeros(4, SEQ, dtype=torch.long)
    tokens = 4 * SEQ
    assert estimate({"input_ids": ids}) == tokens * 32 * 2 + tokens * 8
    assert estimate({"inputs_embeds": embeds, "attention_mask": mask}) == (
        tokens * 32 * 2 + tokens * 8 + mask.numel() * 8
    )
