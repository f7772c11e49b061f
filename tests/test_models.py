"""The Hugging Face adapter: decoder stages never wait for the device, build the
mask and rotary tables once per stage and micro-batch, and train exactly like
the unsplit model (padding and packed sequences included)."""

import copy

import pytest
import torch
from torch import nn

from lightning_roundpipe.models import CausalLMAdapter, _Decoder
from lightning_roundpipe.runtime import RoundPipeEngine, WorkerError
from lightning_roundpipe.runtime.scope import HostSyncError, forbid_host_sync

transformers = pytest.importorskip("transformers")

PLAN = "2,3|1|3,2"  # F1 = embed + decoder 0, F2 = decoders 1-3, B2 = 1-3, B3 = embed + 0


def qwen3():
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        attention_dropout=0.0,
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
