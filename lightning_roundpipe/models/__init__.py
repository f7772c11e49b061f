"""Model adapters: find a module's layer stack and run calls to it through the pipeline.

An adapter knows, for one kind of model, (1) the ordered pipeline layers (made
of the model's own submodules, so parameters and ``state_dict`` keys stay as
they are), (2) which module to intercept, and (3) how a call to that module
becomes engine work:

* :class:`SequentialAdapter`: an ``nn.Sequential``; a call returns the outputs;
  with autograd on, ``backward`` of anything computed from them runs the
  pipelined backward (the engine re-runs the forward with the output gradient).
* :class:`CausalLMAdapter`: Hugging Face decoder-only causal LMs of every
  family in :data:`FAMILIES` (Llama, Qwen2/3, Mistral, Gemma 1-3, Phi,
  GPT-2, GPT-NeoX, OLMo, Cohere, Granite, Falcon, Mixtral, GPT-OSS, DeepSeek
  and 36 more, MoE and linear-attention hybrids included; also wrapped by PEFT).
  Layers: the embedding stage (token embeddings, or the given
  ``inputs_embeds``, and what the family's model does before its first block),
  each decoder block (the mask the model itself builds for that layer, full or
  sliding-window causal, and the rotary embeddings are built from
  ``position_ids`` and the 2-D ``attention_mask`` by a stage's first decoder
  layer, once per micro-batch and kind, and shared by the stage's other
  layers, so only the hidden states cross stage boundaries), and the head
  (final norm, LM head, what the model does to the logits). Whether a batch
  has padding or packed sequences is decided on the host before anything is
  uploaded, so no layer waits for the device to answer it. Called with
  ``labels=`` while training, the loss is computed inside the pipeline (the
  fused stage) per micro-batch and weighted by its share of the batch's real
  tokens, so it equals the unsplit model's loss and full-batch logits never
  exist. Mixture-of-Experts models with ``output_router_logits=True`` add the
  router load-balancing loss: exact per micro-batch, each micro-batch's own
  term weighted like its cross-entropy (see :mod:`.causal_lm`). Config
  settings and call arguments the pipeline layers do not implement are
  refused, never ignored.
* :class:`SequenceClassifierAdapter`: their ``*ForSequenceClassification``
  classes (reward models, classifiers): the same layers with the classifier's
  ``score`` as the head, each row scored at its last non-padding token, and
  the loss (regression, single- or multi-label) computed inside the pipeline
  per micro-batch and weighted by its share of the labelled rows.
* :class:`TokenClassifierAdapter`: their ``*ForTokenClassification`` classes:
  every token scored, the loss over the labelled tokens in the pipeline.
* :class:`QuestionAnsweringAdapter`: their ``*ForQuestionAnswering`` classes
  (extractive question answering): every token scored as the answer's start
  and end, the loss over the answer positions in the pipeline.

Each family is one declarative :class:`Family` entry (:mod:`.families`); the
adapter has no family branches. :func:`find_adapter` picks the adapter for a
LightningModule: the candidate stack holding most of its parameters, refused
when that is not clear. ``describe_layers()`` gives the layer numbering that
plan strings use.
"""

from .._requirements import MIN_TRANSFORMERS, check_transformers
from .base import LayerStackNotFound, SequentialAdapter
from .causal_lm import CausalLMAdapter, causal_lm_loss
from .classifier import (
    QuestionAnsweringAdapter,
    SequenceClassifierAdapter,
    TokenClassifierAdapter,
    question_answering_loss,
    sequence_classification_loss,
    token_classification_loss,
)
from .families import FAMILIES, Family, RouterAux, Setting
from .finding import find_adapter
from .layers import is_packed

__all__ = [
    "FAMILIES",
    "MIN_TRANSFORMERS",
    "CausalLMAdapter",
    "Family",
    "LayerStackNotFound",
    "QuestionAnsweringAdapter",
    "RouterAux",
    "SequenceClassifierAdapter",
    "SequentialAdapter",
    "Setting",
    "TokenClassifierAdapter",
    "causal_lm_loss",
    "check_transformers",
    "find_adapter",
    "is_packed",
    "question_answering_loss",
    "sequence_classification_loss",
    "token_classification_loss",
]
