"""Adapters: each decoder layer gets the mask its model would build (sliding
windows included), config settings and call arguments the pipeline does not
implement are refused, ``inputs_embeds`` trains like the model, the automatic
layer-stack choice refuses when it is not clear, and ``describe_layers``."""

import copy

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.models import (
    CausalLMAdapter,
    LayerStackNotFound,
    SequentialAdapter,
    find_adapter,
)
from lightning_roundpipe.runtime import RoundPipeEngine

transformers = pytest.importorskip("transformers")

VOCAB = 97
SEQ = 12
QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def causal_lm(kind: str, layers: int = 3, **config) -> nn.Module:
    torch.manual_seed(0)
    if kind == "mistral":
        cfg = transformers.MistralConfig(num_hidden_layers=layers, head_dim=8, **SIZES, **config)
        return transformers.MistralForCausalLM(cfg)
    if kind == "qwen2":
        cfg = transformers.Qwen2Config(num_hidden_layers=layers, **SIZES, **config)
        return transformers.Qwen2ForCausalLM(cfg)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(num_hidden_layers=layers, head_dim=8, **SIZES, **config)
        return transformers.Qwen3ForCausalLM(cfg)
    cfg = transformers.LlamaConfig(num_hidden_layers=layers, **SIZES, **config)
    return transformers.LlamaForCausalLM(cfg)


def lm_data(n: int = 16) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, SEQ - 4 :] = 0  # padding in every batch
    return TensorDataset(ids, mask, ids.masked_fill(mask == 0, -100))


def fit(module: L.LightningModule, strategy, devices: int = 1, steps: int = 2) -> L.Trainer:
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=devices, max_steps=steps, **QUIET
    )
    trainer.fit(module, DataLoader(lm_data(), batch_size=8))
    return trainer


def sync() -> RoundPipeStrategy:
    return RoundPipeStrategy(async_optimizer=False, num_microbatches=2)


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4, msg=name)


class LM(L.LightningModule):
    def __init__(self, model: nn.Module, embeds: bool = False) -> None:
        super().__init__()
        self.model = model
        self.embeds = embeds  # call with inputs_embeds= (frozen, computed outside)

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        if self.embeds:
            with torch.no_grad():
                e = self.model.get_input_embeddings()(ids) + 0.5
            out = self.model(inputs_embeds=e, attention_mask=mask, labels=labels)
        else:
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
        self.log("train_loss", out.loss)
        return out.loss

    def configure_optimizers(self):
        # plain SGD: a parameter the step did not use (the embedding when
        # called with inputs_embeds) stays put whether its gradient is None or 0
        if self.embeds:
            return torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


# ------------------------------------------------------------ masks per layer
WINDOWED = {
    # MistralModel: a sliding-window mask for every layer when sliding_window is set
    "mistral": dict(sliding_window=4),
    # Qwen2Model: the mask named by layer_types (layers >= max_window_layers slide)
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "qwen3": dict(
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        use_sliding_window=True,
        sliding_window=3,
    ),
    # LlamaModel never builds a sliding-window mask, whatever the config holds
    "llama": dict(sliding_window=4),
}


def trains_like_the_default_strategy(ref, **lm_kwargs):
    """``ref`` under "auto" and a copy under roundpipe_sync on 2 CPU workers:
    the same loss and weights."""
    mod = LM(copy.deepcopy(ref.model), **lm_kwargs)
    t_ref = fit(ref, "auto")
    t = fit(mod, sync(), devices=2)
    torch.testing.assert_close(
        t.callback_metrics["train_loss"], t_ref.callback_metrics["train_loss"]
    )
    assert_same_weights(mod, ref)


@pytest.mark.parametrize("kind", list(WINDOWED))
def test_sliding_window_layers_train_like_the_model(kind):
    trains_like_the_default_strategy(LM(causal_lm(kind, **WINDOWED[kind])))


def test_each_decoder_gets_the_models_mask_type():
    def sliding(model):
        return [layer.sliding for layer in CausalLMAdapter(model, "m").layers()[1:-1]]

    assert sliding(causal_lm("mistral", sliding_window=4)) == [True] * 3
    assert sliding(causal_lm("mistral", sliding_window=None)) == [False] * 3
    assert sliding(causal_lm("qwen2", **WINDOWED["qwen2"])) == [False, True, True]
    assert sliding(causal_lm("llama", sliding_window=4)) == [False] * 3


# ------------------------------------------------------------ refusals
def test_config_settings_the_pipeline_does_not_implement_are_refused():
    model = causal_lm("qwen3")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(
        ValueError,
        match=r"config\._attn_implementation='flex_attention' is not supported.*"
        r"attn_implementation='sdpa'",
    ):
        CausalLMAdapter(model, "model")

    model = causal_lm("qwen3", layers=2, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(
        ValueError,
        match=r"model: config\.layer_types\[1\]='chunked_attention' is not supported",
    ):
        CausalLMAdapter(model, "model")

    model = causal_lm("llama", layers=2)
    model.config.output_hidden_states = True
    with pytest.raises(ValueError, match=r"config\.output_hidden_states=True is not supported"):
        CausalLMAdapter(model, "model")

    model = causal_lm("llama", layers=2)
    model.config.num_hidden_layers = 1
    with pytest.raises(ValueError, match=r"config\.num_hidden_layers=1, but the model holds 2"):
        CausalLMAdapter(model, "model")

    model = causal_lm("llama", layers=2)
    model.model.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="LlamaModel has forward hooks"):
        CausalLMAdapter(model, "model")
    # found automatically, the same refusal
    model.model._forward_hooks.clear()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"^model: config\._attn_implementation"):
        find_adapter(LM(model))


def attached(model, fn, devices=2):
    adapter = CausalLMAdapter(model, "model")
    with RoundPipeEngine(adapter.layers(), ["cpu"] * devices, 2) as eng:
        adapter.attach(eng)
        try:
            out = fn()
            eng.synchronize()
        finally:
            adapter.detach()
    return out


def test_call_arguments_the_pipeline_does_not_implement_are_refused():
    model = causal_lm("qwen3", layers=2)
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
        {"input_ids": ids, "labels": ids, "logits_to_keep": 1},
        TypeError,
        "logits_to_keep=1 with labels= is not supported",
    )
    model.loss_function = lambda **kw: 0
    check({"input_ids": ids, "labels": ids}, ValueError, "the model's loss_function is")


def test_logits_to_keep_selects_the_models_logits():
    model = causal_lm("qwen3", layers=2).eval()
    ids = torch.randint(0, VOCAB, (4, SEQ))
    with torch.no_grad():
        for keep in (1, torch.tensor([0, 5])):
            expected = model(input_ids=ids, logits_to_keep=keep).logits
            got = attached(model, lambda keep=keep: model(input_ids=ids, logits_to_keep=keep))
            torch.testing.assert_close(got.logits, expected)


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
    model = causal_lm("mistral", sliding_window=5)
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
    model = causal_lm("qwen3", layers=2).eval()
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


def test_inputs_embeds_under_the_strategy_train_like_the_default_strategy():
    trains_like_the_default_strategy(LM(causal_lm("llama", layers=2), embeds=True), embeds=True)


def test_boundary_estimate_reads_inputs_embeds():
    adapter = CausalLMAdapter(causal_lm("llama", layers=2), "m")
    estimate = adapter.boundary_estimate(torch.bfloat16)
    embeds, mask, _ = embed_case()
    ids = torch.zeros(4, SEQ, dtype=torch.long)
    tokens = 4 * SEQ
    assert estimate({"input_ids": ids}) == tokens * 32 * 2 + tokens * 8
    assert estimate({"inputs_embeds": embeds, "attention_mask": mask}) == (
        tokens * 32 * 2 + tokens * 8 + mask.numel() * 8
    )


# ------------------------------------------------------------ finding the stack
class Holder(L.LightningModule):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


def mlp(width: int, depth: int = 2) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def gpt2() -> nn.Module:
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=None,
        eos_token_id=None,
    )
    return transformers.GPT2LMHeadModel(cfg)


def test_an_unsupported_language_model_next_to_a_sequential_is_refused():
    root = Holder(lm=gpt2(), head=nn.Sequential(nn.Linear(VOCAB, 2)))
    with pytest.raises(
        LayerStackNotFound,
        match=r"the largest candidate, 'head' \(Sequential, 196 parameters, 1%\), holds at most "
        r"half of its 30,820 parameters; 'lm' \(GPT2LMHeadModel, 30,624 parameters, 99%\) would "
        r"run outside the pipeline\. 'lm' is a Hugging Face model with model_type 'gpt2', which "
        r"RoundPipe does not support \(supported: llama, mistral, qwen2, qwen3\)",
    ):
        find_adapter(root)
    # asked for explicitly, the small stack is pipelined
    assert isinstance(find_adapter(root, layers="head"), SequentialAdapter)
    # a big module outside that is not a language model
    root = Holder(body=nn.ModuleDict({"a": nn.Linear(64, 64)}), head=mlp(4))
    with pytest.raises(
        LayerStackNotFound,
        match=r"'body' \(ModuleDict, 4,160 parameters, 99%\) would run outside the pipeline\. "
        r"RoundPipe pipelines an nn.Sequential or a Hugging Face causal LM.*put the layers of "
        r"'body' in an nn.Sequential, or pass layers='head'",
    ):
        find_adapter(root)


def test_two_stacks_of_similar_size_are_refused_naming_both():
    root = Holder(enc=mlp(8), dec=mlp(8), bias=nn.Linear(3, 3))
    with pytest.raises(
        LayerStackNotFound,
        match=r"'enc' \(Sequential, 144 parameters, 48%\) and 'dec' \(Sequential, 144 "
        r"parameters, 48%\) are both candidates.*Pass layers='enc' or layers='dec'",
    ):
        find_adapter(root)
    assert find_adapter(root, layers="dec").target is root.dec


def test_the_stack_with_most_parameters_is_chosen():
    # frozen parameters count; the stack need not come first
    small, big = mlp(4), mlp(16, depth=3)
    big.requires_grad_(False)
    root = Holder(small=small, big=big)
    adapter = find_adapter(root)
    assert adapter.target is big and adapter.name == "big"
    # a language model next to a small Sequential: the language model
    lm = causal_lm("qwen3", layers=2)
    adapter = find_adapter(Holder(proj=nn.Sequential(nn.Linear(4, 4)), model=lm))
    assert isinstance(adapter, CausalLMAdapter) and adapter.target is lm
    # shared parameters count once: 'net' shares its first layer with 'alias',
    # still all of the module's parameters are in 'net'
    net = mlp(8)
    root = Holder(alias=net[0], net=net)
    assert find_adapter(root).target is net
    # a Sequential inside another is no candidate of its own
    outer = nn.Sequential(mlp(8), nn.Linear(8, 1))
    assert find_adapter(Holder(outer=outer)).target is outer


def test_no_stack_names_an_unsupported_language_model():
    with pytest.raises(
        LayerStackNotFound,
        match=r"no layer stack found in Holder.*'lm' is a Hugging Face model with model_type "
        r"'gpt2', which RoundPipe does not support",
    ):
        find_adapter(Holder(lm=gpt2()))
    base = causal_lm("llama", layers=1).model  # a LlamaModel: no LM head
    with pytest.raises(
        LayerStackNotFound,
        match=r"'base' is a LlamaModel \(model_type 'llama'\) without an LM head",
    ):
        find_adapter(Holder(base=base))


# ------------------------------------------------------------ layer names
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


def test_describe_layers():
    seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), *[Block() for _ in range(4)], nn.Linear(4, 1))
    assert SequentialAdapter(seq, "net").describe_layers() == (
        "0 Linear, 1 ReLU, 2-5 Block, 6 Linear"
    )
    assert CausalLMAdapter(causal_lm("llama"), "m").describe_layers() == (
        "0 embed, 1-3 blocks, 4 head"
    )
    assert CausalLMAdapter(causal_lm("llama", layers=1), "m").describe_layers() == (
        "0 embed, 1 block, 2 head"
    )
