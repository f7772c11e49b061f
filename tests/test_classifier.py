"""Hugging Face sequence classifiers (``*ForSequenceClassification``) through the
pipeline: scores, losses and training equal the model's own, under plain
Lightning training of the same model."""

from __future__ import annotations

import copy
import functools
import math

import lightning as L
import pytest
import torch
import transformers
from test_adapters import (
    QUIET,
    TINY,
    VOCAB,
    Holder,
    _transformers_class,
    assert_same_weights,
    sync,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES as ANSWERERS,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as CLASSIFIERS,
)
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES as TAGGERS,
)

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.models import (
    LayerStackNotFound,
    QuestionAnsweringAdapter,
    SequenceClassifierAdapter,
    TokenClassifierAdapter,
    find_adapter,
    question_answering_loss,
    sequence_classification_loss,
    token_classification_loss,
)
from lightning_roundpipe.models.layout import _TASKS
from lightning_roundpipe.runtime import RoundPipeEngine

SEQ, PAD = 10, 0
# the task heads (indices into _TASKS, and into the transformers classes' names)
SEQUENCES, TOKENS, ANSWERS = 0, 1, 2
_NAMES = (CLASSIFIERS, TAGGERS, ANSWERERS)


def _classifier_class(kind: str, task: int = SEQUENCES) -> type | None:
    model_type = _transformers_class(TINY[kind][0]).model_type
    name = _NAMES[task].get(model_type)
    return None if name is None else getattr(transformers, name, None)


def _reproduced(cls: type, task: int = SEQUENCES) -> bool:
    owner = next(c for c in cls.__mro__ if "forward" in vars(c))
    return owner.__name__ in _TASKS[task].reproduced


@functools.cache
def _kinds(task: int = SEQUENCES) -> tuple[list[str], list[str]]:
    """The tested families with a sequence or token classifier (or a
    question-answering model): those the pipeline reproduces, those it
    refuses."""
    found = [(k, c) for k in TINY if (c := _classifier_class(k, task)) is not None]
    return (
        [k for k, c in found if _reproduced(c, task)],
        [k for k, c in found if not _reproduced(c, task)],
    )


def classifier(kind: str, num_labels: int = 3, task: int = SEQUENCES, **settings) -> nn.Module:
    """A tiny sequence or token classifier (or question-answering model) of
    the family (random weights, seeded; a token classifier's dropout off)."""
    if task == TOKENS:
        settings = {"classifier_dropout": 0.0, **settings}
    config_cls, _, base = TINY[kind]
    config = _transformers_class(config_cls)(
        **{
            "bos_token_id": None,
            "eos_token_id": None,
            **base,
            **settings,
            "num_labels": num_labels,
            "pad_token_id": PAD,
        }
    )
    cls = _classifier_class(kind, task)
    torch.manual_seed(0)
    try:
        return cls._from_config(config, attn_implementation="sdpa")
    except ValueError:  # no sdpa
        torch.manual_seed(0)
        return cls._from_config(config, attn_implementation="eager")


def data(problem: str = "single", num_labels: int = 3, n: int = 8) -> TensorDataset:
    """Token ids padded with the pad token at the right end of some rows and
    the left end of others; labels of the problem type (a single-label row
    left unlabelled, -100)."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, SEQ - 3 :] = 0
    mask[1::4, :2] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    if problem == "tokens":  # a class per token, none at the padding
        labels = torch.randint(0, num_labels, (n, SEQ), generator=g).masked_fill(mask == 0, -100)
    elif problem == "single":
        labels = torch.randint(0, num_labels, (n,), generator=g)
        labels[n // 2 + 1] = -100
    elif problem == "multi":
        labels = torch.randint(0, 2, (n, num_labels), generator=g).float()
    else:
        labels = torch.randn(n, generator=g)
    return TensorDataset(ids, mask, labels)


class Classifier(L.LightningModule):
    def __init__(
        self, model: nn.Module, with_labels: bool = True, lr: float = 0.5, label_shape=None
    ) -> None:
        super().__init__()
        self.model = model
        self.with_labels = with_labels
        self.lr = lr
        self.label_shape = label_shape  # the labels reshaped to it in training_step
        self.losses: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.validated: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        if self.label_shape is not None:
            labels = labels.reshape(self.label_shape)
        if self.with_labels:
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
            loss = out.loss
        else:  # the loss computed outside the model, from its logits
            out = self.model(input_ids=ids, attention_mask=mask)
            loss = nn.functional.cross_entropy(out.logits, labels)
        self.losses.append(loss.detach().clone())
        self.logits.append(out.logits.detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):
        ids, mask, labels = batch
        out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
        self.validated.append((out.loss.clone(), out.logits.clone()))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def fit(module, strategy, dataset, devices=1, steps=3, validate=False):
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        limit_val_batches=2 if validate else 0,
        num_sanity_val_steps=0,
        **QUIET,
    )
    loader = DataLoader(dataset, batch_size=4)
    trainer.fit(module, loader, loader if validate else None)
    return trainer


def trains_like_the_default_strategy(ref: Classifier, dataset, strategy=None, validate=False):
    mod = type(ref)(copy.deepcopy(ref.model), ref.with_labels, ref.lr, ref.label_shape)
    before = [p.detach().clone() for p in ref.parameters()]
    fit(ref, "auto", dataset, validate=validate)
    fit(mod, strategy or sync(), dataset, devices=2, validate=validate)
    torch.testing.assert_close(torch.stack(mod.losses), torch.stack(ref.losses))
    torch.testing.assert_close(
        torch.stack(mod.logits), torch.stack(ref.logits), atol=1e-5, rtol=1e-4
    )
    assert_same_weights(mod, ref)
    assert any(not torch.equal(a, b) for a, b in zip(before, ref.parameters(), strict=True))
    assert len(mod.validated) == len(ref.validated)
    for (loss, logits), (ref_loss, ref_logits) in zip(mod.validated, ref.validated, strict=True):
        torch.testing.assert_close(loss, ref_loss)
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    return mod


def test_the_tested_families_have_classifiers_to_test():
    reproduced, refused = _kinds()
    assert len(reproduced) >= 45 and {"llama", "qwen3", "gpt2", "opt", "gpt_neox"} <= set(
        reproduced
    )
    assert "cohere_compass_text" in refused  # (its own pooling: mean, first token)


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("llama", "single"),
        ("llama", "multi"),
        ("llama", "regression"),
        ("qwen3_moe", "single"),  # (no router loss: a classifier adds none)
        ("gemma3_text", "single"),  # (no logit soft-capping: the *ForCausalLM's)
        ("minicpm3", "multi"),  # (no hidden divisor: the *ForCausalLM's)
        # the classifiers with forwards of their own
        ("gpt2", "single"),
        ("opt", "regression"),
        ("gpt_neox", "single"),
        ("bloom", "single"),
        ("falcon", "multi"),
        ("gpt_bigcode", "single"),
        ("gpt_neo", "single"),
    ],
)
def test_sequence_classifiers_train_like_the_default_strategy(kind, problem):
    """Losses (each micro-batch weighted by its share of the labelled rows),
    the pooled logits that come back with them, the weights, and evaluation's
    loss and logits, under roundpipe_sync on 2 CPU workers and plain
    Lightning."""
    num_labels = 1 if problem == "regression" else 3
    model = classifier(kind, num_labels)
    # (regression at 0.5 diverges: its third loss is then rounding)
    ref = Classifier(model, lr=0.05 if problem == "regression" else 0.5)
    trains_like_the_default_strategy(ref, data(problem, num_labels), validate=True)
    expected = {"single": "single_label_classification", "multi": "multi_label_classification"}
    assert model.config.problem_type == expected.get(problem, "regression")


@pytest.mark.parametrize("kind", _kinds()[0])
def test_every_family_classifier_scores_like_the_model(kind):
    """Evaluation: the pooled scores and the loss of the model's own forward,
    over two micro-batches on two CPU workers."""
    scores_like_the_model(classifier(kind).eval(), data(), SequenceClassifierAdapter)


def scores_like_the_model(model: nn.Module, dataset: TensorDataset, kind: type) -> None:
    """Evaluation through the pipeline (the adapter found is of ``kind``) gives
    the model's own output: its type, logits and loss."""
    ids, mask, labels = dataset.tensors
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, labels=labels)
    adapter = find_adapter(Holder(model=model))
    assert isinstance(adapter, kind)
    with RoundPipeEngine(adapter.layers(), ["cpu"] * 2, 2) as engine:
        adapter.attach(engine)
        try:
            with torch.no_grad():
                got = model(input_ids=ids, attention_mask=mask, labels=labels)
        finally:
            adapter.detach()
    assert type(got) is type(expected)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.loss, expected.loss)


def test_a_loss_from_the_logits_trains_like_the_default_strategy():
    """Called without labels= while training: the pooled logits carry the
    pipeline's backward."""
    # (at 0.5 the embeddings grow to 30 in three steps, and rounding with them)
    ref = Classifier(classifier("qwen3"), with_labels=False, lr=0.1)
    trains_like_the_default_strategy(ref, data())


@pytest.mark.parametrize(("problem", "shape"), [("regression", (1, -1)), ("single", (-1, 1))])
def test_labels_of_one_value_per_row_in_another_shape_train_like_the_default_strategy(
    problem, shape
):
    """The model flattens (single-label) or squeezes (one regression label)
    the whole batch's labels, so a (1, batch) or (batch, 1) tensor works: the
    pipeline puts the batch first before splitting it."""
    num_labels = 1 if problem == "regression" else 3
    ref = Classifier(classifier("llama", num_labels), lr=0.05, label_shape=shape)
    trains_like_the_default_strategy(ref, data(problem, num_labels))


def test_lora_classifier_trains_like_the_default_strategy():
    """PEFT's task_type="SEQ_CLS": LoRA in the blocks, the score a trainable
    copy (modules_to_save) beside the frozen original."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(classifier("qwen3"), config)
    mod = trains_like_the_default_strategy(Classifier(model), data())
    assert mod.trainer.strategy._adapter.name == "model.base_model.model"


def test_asynchronous_classifier_trains_and_evaluates():
    mod = Classifier(classifier("llama"), lr=0.05)
    before = [p.detach().clone() for p in mod.parameters()]
    strategy = RoundPipeStrategy(num_microbatches=2, plan="2|2|2")
    fit(mod, strategy, data(), devices=2, validate=True)
    assert len(mod.losses) == 3 and all(math.isfinite(float(x)) for x in mod.losses)
    assert mod.validated and all(math.isfinite(float(loss)) for loss, _ in mod.validated)
    assert any(not torch.equal(a, b) for a, b in zip(before, mod.parameters(), strict=True))


def test_the_loss_function_matches_transformers():
    from transformers.loss.loss_utils import ForSequenceClassificationLoss

    g = torch.Generator().manual_seed(0)
    pooled = torch.randn(5, 3, generator=g)
    cases = [
        ("single_label_classification", torch.tensor([0, 2, -100, 1, 1]), 3, pooled),
        ("multi_label_classification", torch.randint(0, 2, (5, 3), generator=g).float(), 3, pooled),
        ("regression", torch.randn(5, generator=g), 1, pooled[:, :1]),
        ("regression", torch.randn(5, 3, generator=g), 3, pooled),
    ]
    for problem, labels, num_labels, logits in cases:
        config = transformers.PretrainedConfig(num_labels=num_labels, problem_type=problem)
        expected = ForSequenceClassificationLoss(labels, logits, config)
        got = sequence_classification_loss(logits, labels, problem, num_labels)
        torch.testing.assert_close(got, expected, msg=problem)
    unlabelled = torch.full((5,), -100)
    problem = "single_label_classification"
    assert float(sequence_classification_loss(pooled, unlabelled, problem, 3)) == 0.0
    assert math.isnan(float(sequence_classification_loss(pooled, unlabelled, problem, 3, None)))


def attached(model: nn.Module, fn, microbatches: int = 2):
    adapter = find_adapter(Holder(model=model))
    with RoundPipeEngine(adapter.layers(), ["cpu"] * 2, microbatches) as engine:
        adapter.attach(engine)
        try:
            return fn()
        finally:
            adapter.detach()


def test_embeddings_are_scored_at_the_last_position_with_a_warning():
    model = classifier("llama").eval()
    ids, mask, _ = data().tensors
    embeds = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        expected = model(inputs_embeds=embeds, attention_mask=mask).logits
    with pytest.warns(UserWarning, match=r"does not detect padding tokens in inputs_embeds"):
        got = attached(model, lambda: model(inputs_embeds=embeds, attention_mask=mask).logits)
    torch.testing.assert_close(got, expected)


def test_classifier_refusals_name_what_to_change():
    model = classifier("llama")
    ids, mask, labels = data(n=4).tensors

    def call(**kwargs):
        return attached(model, lambda: model(input_ids=ids, attention_mask=mask, **kwargs))

    with pytest.raises(TypeError, match=r"logits_to_keep is not an argument of a sequence"):
        call(logits_to_keep=1)
    model.config.problem_type = "ranking"
    with pytest.raises(ValueError, match=r"config\.problem_type='ranking' is not one of"):
        call(labels=labels)
    model.config.problem_type = None
    own = model.loss_function
    model.loss_function = lambda **kwargs: torch.zeros(())
    with pytest.raises(ValueError, match=r"computes transformers' ForSequenceClassification loss"):
        call(labels=labels)
    model.loss_function = own
    model.config.pad_token_id = None
    with pytest.raises(ValueError, match=r"Cannot handle batch sizes > 1 if no padding token"):
        call(labels=labels)
    model.config.pad_token_id = PAD
    # labels the model would refuse, or broadcast across the batch
    with pytest.raises(TypeError, match=r"'single_label_classification' needs integer class"):
        call(labels=labels.float())
    model.config.problem_type = "multi_label_classification"
    with pytest.raises(TypeError, match=r"needs floating-point labels .*pass labels\.float\(\)"):
        call(labels=torch.ones(4, 3, dtype=torch.long))
    with pytest.raises(
        ValueError,
        match=r"labels of shape \(4,\) do not fit a batch of 4 rows with "
        r"config\.problem_type='multi_label_classification' and num_labels=3; give labels of "
        r"shape \(4, 3\)",
    ):
        call(labels=torch.ones(4))
    model.config.problem_type = "regression"
    with pytest.raises(ValueError, match=r"labels of shape \(2, 2\) do not fit a batch of 4"):
        call(labels=torch.ones(2, 2))
    # labels computed by a trainable module: their gradient would be lost
    target = torch.ones(4, 3, requires_grad=True)
    with pytest.raises(ValueError, match=r"labels= requires a gradient, but the RoundPipe"):
        call(labels=target * 2)
    model.config.problem_type = None
    # a term built from the logits returned with labels= cannot reach the weights

    class LogitsTerm(Classifier):
        def training_step(self, batch, batch_idx):
            ids, mask, labels = batch
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
            return out.loss + out.logits.square().mean()

    with pytest.raises(RuntimeError, match=r"a term built from out\.logits \(out\.start_logits"):
        fit(LogitsTerm(model), sync(), data(), devices=2)


def test_classifiers_whose_forward_is_not_reproduced_are_refused():
    """A subclass with its own forward, a classifier that pools otherwise
    (Cohere Compass: mean or first-token pooling), and task heads other than
    a sequence classifier's."""
    model = classifier("llama")
    cls = type(model)
    own = type("MyClassifier", (cls,), {"forward": cls.forward, "__module__": "user_models"})
    model.__class__ = own
    with pytest.raises(
        LayerStackNotFound,
        match=r"'model' is a MyClassifier \(model_type 'llama'\) whose forward "
        r"\(user_models\.MyClassifier\) RoundPipe does not reproduce: it pipelines sequence "
        r"classifiers that score each row's last non-padding token",
    ):
        find_adapter(Holder(model=model))
    model.__class__ = type("Renamed", (cls,), {"__module__": "user_models"})  # same forward
    assert isinstance(find_adapter(Holder(model=model)), SequenceClassifierAdapter)
    for kind in _kinds()[1]:
        with pytest.raises(LayerStackNotFound, match=r"RoundPipe does not reproduce"):
            find_adapter(Holder(model=classifier(kind)))


def test_models_with_another_task_head_are_refused():
    class LlamaForRanking(transformers.LlamaPreTrainedModel):
        def __init__(self, config):
            super().__init__(config)
            self.model = transformers.LlamaModel(config)
            self.ranker = nn.Linear(config.hidden_size, 1)

    ranker = LlamaForRanking(classifier("llama").config)
    with pytest.raises(
        LayerStackNotFound,
        match=r"'model' is a LlamaForRanking \(model_type 'llama'\), a model with a task head "
        r"other than the LM head, a classifier's or a question-answering head",
    ):
        find_adapter(Holder(model=ranker))


# ------------------------------------------------------------ token classifiers
def test_the_tested_families_have_token_classifiers_to_test():
    reproduced, refused = _kinds(TOKENS)
    assert len(reproduced) >= 35 and {"llama", "gpt2", "gpt_neox", "bloom"} <= set(reproduced)
    assert not refused


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gpt2", "gpt_neox", "bloom", "falcon"])
def test_token_classifiers_train_like_the_default_strategy(kind):
    """The loss over the labelled tokens (each micro-batch weighted by its
    share of them), the scores that come back with it, the weights, and
    evaluation's loss and scores."""
    ref = Classifier(classifier(kind, task=TOKENS))
    trains_like_the_default_strategy(ref, data("tokens"), validate=True)


@pytest.mark.parametrize("kind", _kinds(TOKENS)[0])
def test_every_family_token_classifier_scores_like_the_model(kind):
    scores_like_the_model(
        classifier(kind, task=TOKENS).eval(), data("tokens"), TokenClassifierAdapter
    )


def test_a_token_loss_from_the_logits_and_lora_train_like_the_default_strategy():
    from peft import LoraConfig, get_peft_model

    class FromLogits(Classifier):
        def training_step(self, batch, batch_idx):
            ids, mask, labels = batch
            logits = self.model(input_ids=ids, attention_mask=mask).logits
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            self.losses.append(loss.detach().clone())
            self.logits.append(logits.detach().clone())
            return loss

    trains_like_the_default_strategy(
        FromLogits(classifier("qwen3", task=TOKENS), lr=0.1), data("tokens")
    )
    config = LoraConfig(task_type="TOKEN_CLS", r=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(classifier("qwen3", task=TOKENS), config)
    trains_like_the_default_strategy(Classifier(model), data("tokens"))


def test_the_token_loss_matches_transformers():
    from transformers.loss.loss_utils import ForTokenClassification

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 3, generator=g)
    labels = torch.randint(0, 3, (2, 5), generator=g)
    labels[0, :2] = -100
    config = transformers.PretrainedConfig(num_labels=3)
    expected = ForTokenClassification(logits, labels, config)
    torch.testing.assert_close(token_classification_loss(logits, labels), expected)
    none = torch.full((2, 5), -100)
    assert float(token_classification_loss(logits, none)) == 0.0
    assert math.isnan(float(token_classification_loss(logits, none, empty=None)))


def test_token_classifier_refusals_name_what_to_change():
    model = classifier("llama", task=TOKENS)
    ids, mask, labels = data("tokens", n=4).tensors

    def call(**kwargs):
        return attached(model, lambda: model(input_ids=ids, attention_mask=mask, **kwargs))

    with pytest.raises(TypeError, match=r"token classifier's labels are integer class indices"):
        call(labels=labels.float())
    with pytest.raises(
        ValueError,
        match=rf"labels of shape \(4,\) do not fit a batch of 4 rows of {SEQ} tokens; give "
        rf"labels of shape \(4, {SEQ}\)",
    ):
        call(labels=labels[:, 0])
    with pytest.raises(TypeError, match=r"logits_to_keep is not an argument of a token"):
        call(logits_to_keep=1)
    own = model.loss_function
    model.loss_function = lambda *args, **kwargs: torch.zeros(())
    with pytest.raises(ValueError, match=r"computes transformers' ForTokenClassification loss"):
        call(labels=labels)
    model.loss_function = own


# ------------------------------------------------------------ question answering
def answers(n: int = 8) -> TensorDataset:
    """Token ids padded as data()'s, with an answer's start and end token per
    row: one start past the sequence (ignored: the start and end losses then
    count different rows) and one negative end (clamped to the first token,
    as the model does)."""
    ids, mask, _ = data(n=n).tensors
    g = torch.Generator().manual_seed(1)
    start = torch.randint(2, SEQ - 4, (n,), generator=g)
    end = start + torch.randint(0, 3, (n,), generator=g)
    start[2], end[n - 3] = SEQ + 3, -1
    return TensorDataset(ids, mask, start, end)


class Answerer(Classifier):
    """A question-answering model's steps: the loss from start_positions= and
    end_positions= (or, without them, from the scores); the scores kept."""

    def training_step(self, batch, batch_idx):
        ids, mask, start, end = batch
        if self.with_labels:
            out = self.model(
                input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end
            )
            loss = out.loss
        else:
            out = self.model(input_ids=ids, attention_mask=mask)
            ce = nn.functional.cross_entropy
            loss = ce(out.start_logits, start.clamp(0, SEQ - 1)) + ce(out.end_logits, end.clamp(0))
        self.losses.append(loss.detach().clone())
        self.logits.append(torch.stack([out.start_logits, out.end_logits], -1).detach().clone())
        return loss

    def validation_step(self, batch, batch_idx):
        ids, mask, start, end = batch
        out = self.model(
            input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end
        )
        self.validated.append((out.loss.clone(), torch.stack([out.start_logits, out.end_logits])))


def test_the_tested_families_have_question_answering_models_to_test():
    reproduced, refused = _kinds(ANSWERS)
    assert len(reproduced) >= 15 and {"llama", "qwen3", "gpt2", "opt", "bloom"} <= set(reproduced)
    assert not refused


@pytest.mark.parametrize(
    "kind", ["llama", "qwen2_moe", "gpt2", "opt", "gpt_neox", "bloom", "falcon", "gpt_neo"]
)
def test_question_answering_models_train_like_the_default_strategy(kind):
    """The loss over the answer positions (each micro-batch's part divided by
    the batch's counts of start and end positions), the scores that come back
    with it, the weights, and evaluation's loss and scores."""
    trains_like_the_default_strategy(
        Answerer(classifier(kind, task=ANSWERS)), answers(), None, True
    )


@pytest.mark.parametrize("kind", _kinds(ANSWERS)[0])
def test_every_family_question_answering_model_scores_like_the_model(kind):
    model = classifier(kind, task=ANSWERS).eval()
    ids, mask, start, end = answers().tensors
    with torch.no_grad():
        expected = model(
            input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end
        )
        got = attached(
            model,
            lambda: model(
                input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end
            ),
        )
    assert isinstance(find_adapter(Holder(model=model)), QuestionAnsweringAdapter)
    assert type(got) is type(expected)
    for key in ("start_logits", "end_logits", "loss"):
        torch.testing.assert_close(got[key], expected[key], msg=key)


def test_question_answering_from_the_scores_with_lora_and_asynchronous():
    """Without positions the scores carry the pipeline's backward; PEFT's
    QUESTION_ANS (LoRA, qa_outputs trained whole) and the tuple form; the
    asynchronous optimizer trains."""
    from peft import LoraConfig, get_peft_model

    ref = Answerer(classifier("qwen3", task=ANSWERS), with_labels=False, lr=0.1)
    trains_like_the_default_strategy(ref, answers())
    config = LoraConfig(task_type="QUESTION_ANS", r=4, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(classifier("qwen3", task=ANSWERS), config)
    trains_like_the_default_strategy(Answerer(model), answers())
    mod = Answerer(classifier("llama", task=ANSWERS), lr=0.05)
    fit(mod, RoundPipeStrategy(num_microbatches=2), answers(), devices=2, validate=True)
    assert all(math.isfinite(float(x)) for x in mod.losses) and mod.validated
    model = classifier("llama", task=ANSWERS)
    ids, mask, start, end = answers(4).tensors
    with torch.no_grad():
        expected = model(ids, mask, start_positions=start, end_positions=end, return_dict=False)
        got = attached(
            model,
            lambda: model(ids, mask, start_positions=start, end_positions=end, return_dict=False),
        )
    assert len(got) == len(expected) == 3
    for x, y in zip(got, expected, strict=True):
        torch.testing.assert_close(x, y)


def test_the_question_answering_loss_matches_transformers():
    from transformers.loss.loss_utils import ForQuestionAnsweringLoss

    g = torch.Generator().manual_seed(0)
    start_logits, end_logits = torch.randn(2, 5, 7, generator=g).unbind(0)
    start, end = torch.tensor([0, 9, 3, -2, 6]), torch.tensor([1, 4, 7, 6, 6])
    expected = ForQuestionAnsweringLoss(start_logits, end_logits, start, end)
    got = question_answering_loss(start_logits, end_logits, start[:, None], end)
    torch.testing.assert_close(got, expected)
    past = torch.full((5,), 7)
    assert math.isnan(float(question_answering_loss(start_logits, end_logits, past, end)))


def test_a_batch_without_answer_positions_is_refused_or_nan():
    """Every start past the sequence: the model's loss is NaN; with
    nonfinite='raise' (the default) the step is refused saying so."""
    ids, mask, start, end = answers(4).tensors
    start = torch.full_like(start, SEQ)
    mod = Answerer(classifier("llama", task=ANSWERS))
    loader = DataLoader(TensorDataset(ids, mask, start, end), batch_size=4)
    trainer = L.Trainer(strategy=sync(), accelerator="cpu", devices=2, max_steps=1, **QUIET)
    with pytest.raises(Exception, match=r"no labelled answer start \(every position is past the"):
        trainer.fit(mod, loader)


def test_a_batch_without_answer_ends_trains_the_starts_under_nonfinite_ignore():
    """The model's loss is NaN ((start + NaN) / 2) but its gradient the start
    side's: with nonfinite='ignore' the pipeline's too (its NaN weights made
    every weight NaN)."""
    ids, mask, start, end = answers(8).tensors
    end = end.clone()
    end[:4] = SEQ  # (the first batch: no end to count)
    dataset = TensorDataset(ids, mask, start, end)
    ref = Answerer(classifier("llama", task=ANSWERS), lr=0.1)
    mod = Answerer(copy.deepcopy(ref.model), lr=0.1)
    fit(ref, "auto", dataset, steps=2)
    fit(
        mod,
        RoundPipeStrategy(async_optimizer=False, nonfinite="ignore"),
        dataset,
        devices=2,
        steps=2,
    )
    assert math.isnan(float(mod.losses[0])) and math.isfinite(float(mod.losses[1]))
    torch.testing.assert_close(mod.losses[1], ref.losses[1])
    assert_same_weights(mod, ref)


def test_question_answering_refusals_name_what_to_change():
    model = classifier("llama", task=ANSWERS)
    ids, mask, start, end = answers(4).tensors

    def call(**kwargs):
        return attached(model, lambda: model(input_ids=ids, attention_mask=mask, **kwargs))

    with pytest.raises(TypeError, match=r"takes the answer as start_positions= and end_positions="):
        call(labels=start)
    with pytest.raises(TypeError, match=r"start_positions are token indices \(one per row\), got"):
        call(start_positions=start.float(), end_positions=end)
    with pytest.raises(
        ValueError,
        match=r"end_positions of shape \(2,\) do not fit a batch of 4 rows; give end_positions "
        r"of shape \(4,\)",
    ):
        call(start_positions=start, end_positions=end[:2])
    own = model.loss_function
    model.loss_function = lambda *args, **kwargs: torch.zeros(())
    with pytest.raises(ValueError, match=r"with start_positions= and end_positions= the RoundPipe"):
        call(start_positions=start, end_positions=end)
    model.loss_function = own


@pytest.mark.gpu
@pytest.mark.parametrize("task", [SEQUENCES, TOKENS, ANSWERS], ids=["sequence", "token", "qa"])
def test_classifiers_on_gpu_workers_train_like_the_default_strategy_on_the_cpu(task):
    """The scores come back with the loss from CUDA workers (downloaded with
    it): losses, scores, weights and evaluation as plain Lightning's."""
    model = classifier("llama", task=task)
    steps = Answerer if task == ANSWERS else Classifier
    ref, mod = steps(copy.deepcopy(model)), steps(model)
    dataset = {SEQUENCES: data(), TOKENS: data("tokens"), ANSWERS: answers()}[task]
    fit(ref, "auto", dataset, validate=True)
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=RoundPipeStrategy(async_optimizer=False, num_microbatches=2, workers_per_device=2),
        accelerator="cuda",
        devices=1,
        max_steps=3,
        limit_val_batches=2,
        num_sanity_val_steps=0,
        **QUIET,
    )
    loader = DataLoader(dataset, batch_size=4)
    trainer.fit(mod, loader, loader)
    close = functools.partial(torch.testing.assert_close, atol=1e-4, rtol=1e-3)
    close(torch.stack(mod.losses).cpu(), torch.stack(ref.losses))
    close(torch.stack(mod.logits).cpu(), torch.stack(ref.logits))
    for (name, x), y in zip(mod.named_parameters(), ref.parameters(), strict=True):
        close(x.detach().cpu(), y.detach(), msg=name)
    for (loss, logits), (ref_loss, ref_logits) in zip(mod.validated, ref.validated, strict=True):
        close(loss.cpu(), ref_loss)
        close(logits.cpu(), ref_logits)
