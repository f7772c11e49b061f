"""The adapters for Hugging Face sequence classifiers (``*ForSequenceClassification``
of the supported families, also wrapped by PEFT): reward models, sentiment or
preference classifiers fine-tuned from a causal LM; and for their token
classifiers (``*ForTokenClassification``) and extractive question-answering
models (``*ForQuestionAnswering``), which score every token.

The pipeline layers are the causal LM adapter's (:mod:`.causal_lm`), but the
head is the final norm and the classifier's ``score`` (what the family's
``*Model`` does after its last block, none of what a ``*ForCausalLM`` does to
its logits). The model scores every position and keeps each row's score at its
last non-padding token (the last position without a pad token): which position
that is, is decided on the host from ``input_ids``, as the model decides it.
Called with ``labels=`` while training, the loss (transformers'
sequence-classification loss: regression, single- or multi-label, by
``config.problem_type`` decided as the model decides it) is computed inside the
pipeline per micro-batch and weighted by its share of the batch's labelled
rows, so it equals the unsplit model's loss; the pooled logits come back with it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from .base import _anchor, _from_pipeline, _give_factor, _needing_grad
from .causal_lm import _HANDLED, CausalLMAdapter
from .layers import _AltUpOut, _Head
from .layout import (
    QUESTION_ANSWERING,
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
    _forward_owner,
)

__all__ = [
    "QuestionAnsweringAdapter",
    "SequenceClassifierAdapter",
    "TokenClassifierAdapter",
    "question_answering_loss",
    "sequence_classification_loss",
    "token_classification_loss",
]

PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def problem_type(config: Any, labels: torch.Tensor) -> str:
    """``config.problem_type``, set first (as the model sets it, once) from
    the number of labels and the labels' dtype when it is None."""
    if config.problem_type is None:
        if config.num_labels == 1:
            config.problem_type = "regression"
        elif labels.dtype in (torch.long, torch.int):
            config.problem_type = "single_label_classification"
        else:
            config.problem_type = "multi_label_classification"
    return config.problem_type


def sequence_classification_loss(
    pooled: torch.Tensor,
    labels: torch.Tensor,
    problem: str,
    num_labels: int,
    empty: float | None = 0.0,
) -> torch.Tensor:
    """Transformers' sequence-classification loss of the pooled logits
    (computed in fp32): mean squared error (``regression``), cross-entropy
    over the rows whose label is not -100 (``single_label_classification``;
    with none: ``empty``, or NaN with ``empty=None`` as the model's own loss),
    or binary cross-entropy with logits (``multi_label_classification``)."""
    fn = nn.functional
    labels = labels.to(pooled.device)
    pooled = pooled.float()
    if problem == "regression":
        if num_labels == 1:
            return fn.mse_loss(pooled.squeeze(), labels.squeeze().float())
        return fn.mse_loss(pooled, labels.float())
    if problem == "single_label_classification":
        target = labels.reshape(-1)
        count = (target != -100).sum()
        total = fn.cross_entropy(
            pooled.reshape(-1, num_labels), target, ignore_index=-100, reduction="sum"
        )
        return total / (count if empty is None else count.clamp(min=1))
    return fn.binary_cross_entropy_with_logits(pooled, labels.float())


def _indices(name: str, key: str, value: Any, what: str) -> None:
    """Refuse ``value`` (the call's ``key``) unless it is a tensor of integer
    indices; ``what`` says of what, for the error."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: {key} must be a tensor, got {type(value).__name__}")
    if value.is_floating_point() or value.dtype == torch.bool:
        raise TypeError(f"{name}: {what}, got {value.dtype}; pass {key}.long()")


def _pool(scores: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """Each row's score at its last non-padding position."""
    last = last.to(scores.device)
    return scores[torch.arange(scores.shape[0], device=scores.device), last]


class _ClassifierLoss:
    """The pipeline's loss function: the loss of a micro-batch's pooled
    scores, which come back with it (``with_outputs``)."""

    def __init__(self, problem: str, num_labels: int) -> None:
        self.problem = problem
        self.num_labels = num_labels

    def __call__(self, scores: torch.Tensor, labels: dict[str, torch.Tensor]) -> Any:
        pooled = _pool(scores, labels["last"])
        loss = sequence_classification_loss(pooled, labels["labels"], self.problem, self.num_labels)
        return loss, pooled


class _NoGradient(torch.autograd.Function):
    """Logits that came back with a loss computed inside the pipeline: they
    are the model's, but a loss built from them cannot reach the weights."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return value.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        raise RuntimeError(
            "a backward reached the scores a RoundPipe classifier returned with labels= (or a "
            "question-answering model with start_positions= and end_positions=): its loss "
            "(out.loss) was computed, and its backward run, inside the pipeline, so a term "
            "built from out.logits (out.start_logits, out.end_logits) cannot reach the weights. "
            "Use the scores for metrics only (detached), or call the model without the labels "
            "and compute the whole loss from the scores"
        )


class SequenceClassifierAdapter(CausalLMAdapter):
    """A Hugging Face ``*ForSequenceClassification`` of a supported family
    whose forward pools the last non-padding token's score (see
    :mod:`.classifier`; optionally inside PEFT)."""

    kind = "Hugging Face sequence classifier"
    router_loss = False  # (a classifier adds no router load-balancing loss)
    task = SEQUENCE_CLASSIFICATION
    loss_name = "ForSequenceClassification"  # (the model's loss_function, transformers')
    labels = "labels="  # (what the loss is computed from, for messages)
    handled = _HANDLED  # (a causal LM's loss arguments are not a classifier's)
    scores = "the logits"

    def __init__(self, target: nn.Module, name: str) -> None:
        super().__init__(target, name)
        if self.layout.task != self.task:
            raise ValueError(
                f"{name}: a {type(target).__name__} is not a {self.kind.split(' ', 2)[-1]}; "
                "find its adapter with find_adapter"
            )
        self._logit_width = int(target.config.num_labels)
        # whether the forward computes the loss with the model's loss_function
        # (else inline, with the same losses)
        forward = inspect.unwrap(_forward_owner(target).forward)
        self._uses_loss_function = "loss_function" in forward.__code__.co_names
        self._warned_embeds = False

    def _head(self, target: nn.Module, layout: Any) -> nn.Module:
        """The final norm (and what the family's ``*Model`` does after its
        last block) and the score, for every position."""
        family = layout.family
        return _Head(
            layout.norm,
            layout.lm_head,
            project_out=layout.project_out,
            pre=_AltUpOut(layout.base) if family.altup else layout.head_pre,
        )

    def _head_numbers(self, target: nn.Module) -> list[tuple[nn.Module, str, Any, Any]]:
        return []  # (the logit scales are the *ForCausalLM's)

    def tiles_for(self, budget: int, dtype: torch.dtype, loss: bool = True) -> dict[str, int]:
        """Block tiles as a causal LM's; no loss chunks (a few scores per token)."""
        return super().tiles_for(budget, dtype, loss=False)

    def activation_model(self, dtype: torch.dtype, tiles: dict[str, int], **kwargs: Any) -> Any:
        """As a causal LM's, with the head's scores and no loss in the probes
        (the loss of a few scores per token adds nothing worth measuring)."""
        kwargs["loss"] = False
        return super().activation_model(dtype, tiles, **kwargs)

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        values = super()._arguments(args, kwargs)
        if values.get("logits_to_keep") is not None:
            raise TypeError(
                f"{self.name}: logits_to_keep is not an argument of a "
                f"{self.kind.split(' ', 2)[-1]}; call the model without it"
            )
        return values

    def _check_labels(self, a: dict[str, Any]) -> None:
        """Refuse a loss the pipeline would not compute as the model does: a
        ``loss_function`` of the user's, an unknown ``config.problem_type``."""
        config = self.target.config
        if config.problem_type not in (None, *PROBLEM_TYPES):
            raise ValueError(
                f"{self.name}: config.problem_type={config.problem_type!r} is not one of "
                f"{', '.join(map(repr, PROBLEM_TYPES))}; set config.problem_type to one of them "
                "(or None to let the labels decide)"
            )
        a["labels"] = self._batch_labels(a)
        self._check_loss_function()

    def _check_loss_function(self) -> None:
        """Refuse a ``loss_function`` of the user's where the model's forward
        calls it (the others compute transformers' loss inline)."""
        if not self._uses_loss_function:
            return
        from transformers.loss.loss_utils import LOSS_MAPPING

        fn, expected = self.target.loss_function, LOSS_MAPPING[self.loss_name]
        if fn is not expected:
            raise ValueError(
                f"{self.name}: the model's loss_function is {getattr(fn, '__name__', fn)!r}, but "
                f"with {self.labels} the RoundPipe pipeline computes transformers' "
                f"{self.loss_name} loss ({expected.__name__}); call the model without "
                f"{self.labels} and compute the loss from {self.scores}"
            )

    def _batch_labels(self, a: dict[str, Any]) -> torch.Tensor:
        """The call's labels, checked, with the batch first as the pipeline
        splits them: one value per row (single-label class indices; regression
        targets of one label) or a row of ``num_labels`` targets each. Refused
        where the model would fail or broadcast them across the batch, and
        when they require a gradient (the loss is computed inside the
        pipeline, from a copy)."""
        labels, name = a["labels"], self.name
        config = self.target.config
        num_labels = int(config.num_labels)
        if not isinstance(labels, torch.Tensor):
            raise TypeError(f"{name}: labels must be a tensor, got {type(labels).__name__}")
        if labels.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                f"{name}: labels= requires a gradient, but the RoundPipe pipeline computes the "
                "loss on its workers from a copy of the labels, so no gradient would reach "
                "what computed them; detach the labels, or call the model without labels= and "
                "compute the loss from out.logits"
            )
        ids = a.get("input_ids")
        rows = int((ids if ids is not None else a["inputs_embeds"]).shape[0])
        problem = problem_type(config, labels)
        if problem == "single_label_classification":
            if labels.is_floating_point() or labels.dtype == torch.bool:
                raise TypeError(
                    f"{name}: config.problem_type='single_label_classification' needs integer "
                    f"class indices as labels (-100: none), got {labels.dtype}; pass "
                    "labels.long(), or set problem_type='multi_label_classification' for a "
                    "target per label"
                )
            per_row, expected = 1, f"({rows},) or ({rows}, 1): a class index per row"
        elif problem == "regression" and num_labels == 1:
            per_row, expected = 1, f"({rows},) or ({rows}, 1): a target per row"
        else:
            if problem == "multi_label_classification" and not labels.is_floating_point():
                raise TypeError(
                    f"{name}: config.problem_type='multi_label_classification' needs "
                    f"floating-point labels (a 0/1 target per label), got {labels.dtype}, "
                    "which the model's binary cross-entropy refuses; pass labels.float()"
                )
            per_row, expected = num_labels, f"({rows}, {num_labels}): {num_labels} targets per row"
        if labels.numel() != rows * per_row or (per_row > 1 and labels.shape != (rows, per_row)):
            raise ValueError(
                f"{name}: labels of shape {tuple(labels.shape)} do not fit a batch of {rows} rows "
                f"with config.problem_type={problem!r} and num_labels={num_labels}; give labels "
                f"of shape {expected}"
            )
        return labels.reshape(rows) if per_row == 1 else labels

    def _last_tokens(self, a: dict[str, Any], batch: torch.Tensor) -> torch.Tensor:
        """Each row's last non-padding position (the model's rule: the
        rightmost token that is not the pad token, left or right padding
        alike; the last position without a pad token or with embeddings)."""
        config = self.target.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        pad, rows, seq = text.pad_token_id, int(batch.shape[0]), int(batch.shape[1])
        if pad is None and rows != 1:
            # the model's own check, with its message
            raise ValueError("Cannot handle batch sizes > 1 if no padding token is defined.")
        ids = a.get("input_ids")
        if pad is None or ids is None:
            if pad is not None and not self._warned_embeds:
                self._warned_embeds = True
                rank_zero_warn(
                    f"{self.name}: {type(self.target).__name__} does not detect padding tokens "
                    "in inputs_embeds (as the model itself): each row is scored at its last "
                    "position"
                )
            return torch.full((rows,), seq - 1, dtype=torch.long)
        positions = torch.arange(seq, device=ids.device)
        return (positions * (ids != pad)).argmax(-1).cpu()

    def call(self, *args: Any, **kwargs: Any) -> Any:
        a, inputs, batch, as_tuple = self._prepare(args, kwargs)
        labels = a.get("labels")
        last = self._last_tokens(a, batch)
        config, engine = self.target.config, self.engine
        num_labels = int(config.num_labels)
        problem = None if labels is None else config.problem_type  # (set by _check_labels)
        training = self._wants_backward(inputs)
        if training and labels is not None:
            loss, scores = self._trained(
                inputs,
                {"labels": labels, "last": last},
                _ClassifierLoss(problem, num_labels),
                lambda ys: self._row_weights(ys, problem),
            )
            return self._output(as_tuple, loss=loss, logits=scores)
        if training:
            scores = self._outputs_with_backward(inputs)
            return self._output(as_tuple, logits=_pool(scores, last))
        pooled = _pool(engine.forward(inputs), last)
        loss = None
        if labels is not None:
            loss = sequence_classification_loss(pooled, labels, problem, num_labels, empty=None)
        return self._output(as_tuple, loss=loss, logits=pooled)

    def _trained(
        self,
        inputs: dict[str, Any],
        labels: Any,
        loss_fn: Callable[[Any, Any], Any],
        weights: Callable[[list[Any]], list[float]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A training call with labels: the loss computed inside the
        pipeline (``loss_fn`` returns it and the scores, which come back with
        it), in the caller's graph with the factor autograd brings to it, as
        a causal LM's; and the scores for metrics, without a gradient."""
        engine = self.engine
        loss, scores = engine.forward_backward(
            inputs,
            labels=labels,
            loss_fn=loss_fn,
            loss_weights=weights,
            scale="later",
            input_grads=bool(_needing_grad(inputs)),
            with_outputs=True,
        )
        loss = _from_pipeline(loss, engine, engine.iteration - 1, inputs, _give_factor)
        return loss, _NoGradient.apply(_anchor(), scores)

    def _row_weights(self, labels: list[dict[str, torch.Tensor]], problem: str) -> list[float]:
        """Each micro-batch's share of the batch's labelled rows (single-label:
        those whose label is not -100; else every row, each with all its
        labels)."""
        if problem == "single_label_classification":
            counts = [int((y["labels"].reshape(-1) != -100).sum()) for y in labels]
            return self._shares(counts, "row")
        return self._shares([int(y["last"].shape[0]) for y in labels], "row")

    def _output(self, as_tuple: bool, aux_loss: torch.Tensor | None = None, **fields: Any) -> Any:
        """``SequenceClassifierOutputWithPast`` (its tuple with ``as_tuple``)."""
        from transformers.modeling_outputs import SequenceClassifierOutputWithPast

        out = SequenceClassifierOutputWithPast(**fields)
        return out.to_tuple() if as_tuple else out


# ------------------------------------------------------------ token classifiers
def token_classification_loss(
    logits: torch.Tensor, labels: torch.Tensor, empty: float | None = 0.0
) -> torch.Tensor:
    """Transformers' token-classification loss (in fp32): the mean
    cross-entropy over the tokens whose label is not -100 (with none:
    ``empty``, or NaN with ``empty=None`` as the model's own loss)."""
    target = labels.reshape(-1).to(logits.device)
    count = (target != -100).sum()
    flat = logits.float().reshape(-1, logits.shape[-1])
    total = nn.functional.cross_entropy(flat, target, ignore_index=-100, reduction="sum")
    return total / (count if empty is None else count.clamp(min=1))


def _token_loss(scores: torch.Tensor, labels: torch.Tensor) -> Any:
    """The pipeline's loss function of a token classifier: the loss of a
    micro-batch, and its scores, which come back with it (``with_outputs``)."""
    return token_classification_loss(scores, labels), scores


class TokenClassifierAdapter(SequenceClassifierAdapter):
    """A Hugging Face ``*ForTokenClassification`` of a supported family: the
    causal LM's layers with the final norm, the classifier's dropout and its
    score as the head; every token is scored. Called with ``labels=`` while
    training, the loss (the cross-entropy over the labelled tokens, as the
    model computes it) is computed inside the pipeline per micro-batch,
    weighted by its share of the labelled tokens, and the scores come back
    with it."""

    kind = "Hugging Face token classifier"
    task = TOKEN_CLASSIFICATION
    loss_name = "ForTokenClassification"

    def _head(self, target: nn.Module, layout: Any) -> nn.Module:
        """The final norm (and what the family's ``*Model`` does after its
        last block), the classifier's dropout and its score."""
        dropout = target._modules.get("dropout")
        # (a container of the model's own modules: their names in the model stay)
        score = layout.lm_head if dropout is None else nn.Sequential(dropout, layout.lm_head)
        family = layout.family
        return _Head(
            layout.norm,
            score,
            project_out=layout.project_out,
            pre=_AltUpOut(layout.base) if family.altup else layout.head_pre,
        )

    def _check_labels(self, a: dict[str, Any]) -> None:
        """Refuse labels the model would not read as a class index per token,
        or a ``loss_function`` of the user's."""
        a["labels"] = self._batch_labels(a)
        self._check_loss_function()

    def _batch_labels(self, a: dict[str, Any]) -> torch.Tensor:
        """The call's labels, checked: a class index per token (-100: none),
        shaped (batch, sequence) as the pipeline splits them."""
        labels, name = a["labels"], self.name
        ids = a.get("input_ids")
        batch = ids if ids is not None else a["inputs_embeds"]
        rows, seq = int(batch.shape[0]), int(batch.shape[1])
        _indices(
            name,
            "labels",
            labels,
            "a token classifier's labels are integer class indices (-100: none)",
        )
        if labels.numel() != rows * seq:
            raise ValueError(
                f"{name}: labels of shape {tuple(labels.shape)} do not fit a batch of {rows} rows "
                f"of {seq} tokens; give labels of shape ({rows}, {seq}): a class index per token"
            )
        return labels.reshape(rows, seq)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        a, inputs, _, as_tuple = self._prepare(args, kwargs)
        labels, engine = a.get("labels"), self.engine
        training = self._wants_backward(inputs)
        if training and labels is not None:
            loss, scores = self._trained(inputs, labels, _token_loss, self._labelled_tokens)
            return self._output(as_tuple, loss=loss, logits=scores)
        if training:
            return self._output(as_tuple, logits=self._outputs_with_backward(inputs))
        scores = engine.forward(inputs)
        loss = None if labels is None else token_classification_loss(scores, labels, empty=None)
        return self._output(as_tuple, loss=loss, logits=scores)

    def _labelled_tokens(self, labels: list[torch.Tensor]) -> list[float]:
        """Each micro-batch's share of the batch's labelled tokens."""
        return self._shares([int((y != -100).sum()) for y in labels], "token")

    def _output(self, as_tuple: bool, aux_loss: torch.Tensor | None = None, **fields: Any) -> Any:
        """``TokenClassifierOutput`` (its tuple with ``as_tuple``)."""
        from transformers.modeling_outputs import TokenClassifierOutput

        out = TokenClassifierOutput(**fields)
        return out.to_tuple() if as_tuple else out


# ------------------------------------------------------------ question answering
def question_answering_loss(
    start_logits: torch.Tensor,
    end_logits: torch.Tensor,
    start_positions: torch.Tensor,
    end_positions: torch.Tensor,
) -> torch.Tensor:
    """Transformers' extractive question-answering loss (in fp32): the mean of
    the start and the end positions' cross-entropies, each over the rows whose
    position is inside the sequence (positions are clamped to ``[0,
    sequence]`` first, as the model does: a negative one is the first token,
    one past the end is ignored; with none: NaN, as the model's)."""
    seq = start_logits.shape[1]
    total = start_logits.new_zeros((), dtype=torch.float32)
    for logits, positions in ((start_logits, start_positions), (end_logits, end_positions)):
        target = positions.reshape(-1).clamp(0, seq).long().to(logits.device)
        total = total + nn.functional.cross_entropy(logits.float(), target, ignore_index=seq)
    return total / 2


class _AnswerLoss:
    """The pipeline's loss function of a question-answering model: a
    micro-batch's part of the batch's loss (its start and end cross-entropy
    sums over the batch's counted positions: the two means have different
    counts, so no single weight per micro-batch would do), and its scores,
    which come back with it (``with_outputs``)."""

    def __init__(self, starts: int, ends: int) -> None:
        self.counts = (starts, ends)

    def __call__(self, scores: torch.Tensor, labels: dict[str, torch.Tensor]) -> Any:
        seq = scores.shape[1]
        total = scores.new_zeros((), dtype=torch.float32)
        for i, key in enumerate(("start", "end")):
            target = labels[key].to(scores.device)
            part = nn.functional.cross_entropy(
                scores[..., i].float(), target, ignore_index=seq, reduction="sum"
            )
            # a side with nothing to count: NaN, as the model's mean over no
            # rows, with no gradient (the other side's still trains, as there)
            empty = torch.full((), math.nan, device=scores.device)
            total = total + (part / self.counts[i] if self.counts[i] else part * 0 + empty)
        return total / 2, scores


class QuestionAnsweringAdapter(SequenceClassifierAdapter):
    """A Hugging Face ``*ForQuestionAnswering`` of a supported family
    (extractive question answering; also inside PEFT's QUESTION_ANS): the
    causal LM's layers with the final norm and ``qa_outputs`` as the head,
    which scores every token as the answer's start and end. Called with
    ``start_positions=`` and ``end_positions=`` while training, the loss (the
    mean of the start and end cross-entropies, as the model computes it) is
    computed inside the pipeline per micro-batch, each micro-batch's part
    divided by the whole batch's counts, and the scores come back with it."""

    kind = "Hugging Face question-answering model"
    task = QUESTION_ANSWERING
    loss_name = "ForQuestionAnswering"
    labels = "start_positions= and end_positions="
    scores = "out.start_logits and out.end_logits"
    handled = (*(k for k in _HANDLED if k != "labels"), "start_positions", "end_positions")

    def __init__(self, target: nn.Module, name: str) -> None:
        super().__init__(target, name)
        self._logit_width = 2  # (a start and an end score per token)

    def _arguments(self, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
        if kwargs.get("labels") is not None:
            raise TypeError(
                f"{self.name}: a question-answering model takes the answer as start_positions= "
                "and end_positions= (its first and last token's index in each row), not labels="
            )
        return super()._arguments(args, kwargs)

    def _check_call(self, a: dict[str, Any]) -> None:
        super()._check_call(a)
        if a.get("start_positions") is not None and a.get("end_positions") is not None:
            ids = a.get("input_ids")
            rows = int((ids if ids is not None else a["inputs_embeds"]).shape[0])
            for key in ("start_positions", "end_positions"):
                a[key] = self._positions(a[key], key, rows)
            self._check_loss_function()

    def _positions(self, positions: Any, key: str, rows: int) -> torch.Tensor:
        """One answer position per row, as the model reads them (a (rows,) or
        (rows, 1) integer tensor)."""
        name = self.name
        _indices(name, key, positions, f"{key} are token indices (one per row)")
        if positions.numel() != rows or positions.dim() > 2:
            raise ValueError(
                f"{name}: {key} of shape {tuple(positions.shape)} do not fit a batch of {rows} "
                f"rows; give {key} of shape ({rows},): the answer's token index in each row"
            )
        return positions.reshape(rows)

    def call(self, *args: Any, **kwargs: Any) -> Any:
        a, inputs, batch, as_tuple = self._prepare(args, kwargs)
        starts, ends = a.get("start_positions"), a.get("end_positions")
        answered = starts is not None and ends is not None  # (else no loss, as the model)
        training = self._wants_backward(inputs)
        if training and answered:
            seq = int(batch.shape[1])
            starts, ends = starts.clamp(0, seq).long(), ends.clamp(0, seq).long()
            counts = int((starts != seq).sum()), int((ends != seq).sum())
            loss, scores = self._trained(
                inputs,
                {"start": starts, "end": ends},
                _AnswerLoss(*counts),
                lambda ys: self._answer_weights(len(ys), counts),
            )
            return self._answers(as_tuple, scores, loss)
        if training:
            return self._answers(as_tuple, self._outputs_with_backward(inputs))
        scores = self.engine.forward(inputs)
        loss = None
        if answered:
            loss = question_answering_loss(scores[..., 0], scores[..., 1], starts, ends)
        return self._answers(as_tuple, scores, loss)

    def _answer_weights(self, microbatches: int, counts: tuple[int, int]) -> list[float]:
        """Each micro-batch's part counts whole (it is divided by the batch's
        counts already). No start or no end to count: the loss is NaN, as the
        model's (refused first with ``nonfinite="raise"``; with ``"ignore"``
        the other side trains, as in the model)."""
        what = "answer start" if not counts[0] else "answer end"
        none = [0] * microbatches
        past = "every position is past the sequence"
        if not any(counts):
            return self._shares(none, what, past)
        engine = self.engine
        if not all(counts) and engine is not None and engine.nonfinite == "raise":
            self._shares(none, what, past)  # (raises, naming the empty side)
        return [1.0] * microbatches

    def _answers(
        self, as_tuple: bool, scores: torch.Tensor, loss: torch.Tensor | None = None
    ) -> Any:
        """``QuestionAnsweringModelOutput`` of the scores (its tuple with
        ``as_tuple``): their start and end columns, as the model splits them."""
        from transformers.modeling_outputs import QuestionAnsweringModelOutput

        start, end = (x.squeeze(-1).contiguous() for x in scores.split(1, dim=-1))
        out = QuestionAnsweringModelOutput(loss=loss, start_logits=start, end_logits=end)
        return out.to_tuple() if as_tuple else out
