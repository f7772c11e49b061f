"""The decoder-only causal-LM families the Hugging Face adapter pipelines.

Every family is one :class:`Family` entry: where its ``*ForCausalLM`` keeps the
pieces (read from each family's ``*Model.forward`` and ``*ForCausalLM.forward``
in transformers 5), what the model does before the first decoder block and
after the last, how it picks each block's attention mask, and which config
settings the pipeline layers do not implement. The adapter itself has no
family branches: it reads these fields.

To add a family, read its modeling file and write one entry (the defaults are
the Llama layout: ``model.embed_tokens``, ``model.layers``, ``model.norm``,
``lm_head``, ``model.rotary_emb``, one causal mask for every layer), then add
it to the parametrized test in ``tests/test_adapters.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FAMILIES",
    "INDEXED_KINDS",
    "MASKLESS_KINDS",
    "RECURRENT_KINDS",
    "Family",
    "RouterAux",
    "Setting",
    "family_for",
    "supported_families",
]

# how a family's *Model picks each decoder layer's mask
FULL = "full"  # one causal mask for every layer (LlamaModel)
SLIDING_IF_WINDOW = "sliding_if_window"  # every layer sliding when config.sliding_window is set
LAYER_TYPES = "layer_types"  # the mask named by config.layer_types[i]
MASK_RULES = (FULL, SLIDING_IF_WINDOW, LAYER_TYPES)
# the attention types most models build masks for (their causal_mask_mapping keys)
LAYER_KINDS = ("full_attention", "sliding_attention")
# a linear-attention block gets the 2-D padding mask (create_recurrent_attention_mask)
HYBRID_KINDS = ("full_attention", "linear_attention")
# the layer types that get that padding mask: linear attention and Mamba
# blocks, short convolutions (LFM2)
RECURRENT_KINDS = ("linear_attention", "conv")
# layer types without attention, which get no mask (NemotronH's MLP and MoE blocks)
MASKLESS_KINDS = ("mlp", "moe")
# layer types whose sparse-attention indexer reads the causal mask: it is always
# built (allow_is_causal_skip=False, Dots3 Note's)
INDEXED_KINDS = ("indexed_attention",)


@dataclass(frozen=True)
class Setting:
    """A config setting the pipeline layers do not implement: ``config.<name>``
    must be ``supported`` (a missing attribute counts as supported)."""

    name: str
    supported: Any
    why: str


@dataclass(frozen=True)
class RouterAux:
    """The router load-balancing loss a Mixture-of-Experts ``*ForCausalLM`` adds
    when ``output_router_logits`` is on: ``coef * load_balancing_loss_func(
    router_logits, experts, top_k, attention_mask)``. Fields: the
    ``*ForCausalLM`` attributes the model reads them from."""

    experts: str = "num_experts"
    top_k: str = "num_experts_per_tok"
    coef: str = "router_aux_loss_coef"


@dataclass(frozen=True)
class Family:
    """One decoder-only causal-LM family.

    Module paths (``embed``, ``layers``, ``norm``, ``rotary``, ``positions``,
    ``embed_dropout``) are attributes of the inner ``*Model`` (``base``, an
    attribute of the ``*ForCausalLM``); ``lm_head`` is an attribute of the
    ``*ForCausalLM``. Scalars (``embed_multiplier``, ``logit_*``) are dotted
    paths from the ``*ForCausalLM`` (``"config.logits_scaling"``)."""

    name: str
    model_types: tuple[str, ...]
    base: str = "model"
    embed: str = "embed_tokens"
    layers: str = "layers"
    norm: str = "norm"
    lm_head: str = "lm_head"
    # rotary embedding module, None: the family has none
    rotary: str | None = "rotary_emb"
    # the *Model builds the rotary module only when its config asks for rotary
    # positions (GraniteMoeHybrid): a missing one means none
    rotary_optional: bool = False
    # rotary(hidden, positions, layer_type): one table per attention type (Gemma 3)
    rotary_per_layer_type: bool = False
    # the config list giving each layer's rotary base (Granite SWA's
    # layer_rope_theta; 0 or None: no positions): each layer gets the module of
    # the ``rotary`` list built for its base
    rotary_by_theta: str | None = None
    # the layer types whose rotary table the model computes for fp32 inputs
    # (in fp32 whatever the compute dtype: Dots3 Note's indexed-attention layers)
    rotary_fp32_kinds: tuple[str, ...] = ()
    # the layer types given the rotary table (None: all; the others get
    # position_embeddings=None, as LaraMini's full-attention layers)
    rotary_kinds: tuple[str, ...] | None = None
    # a layer type whose config.rope_parameters entry is None gets no rotary
    # table (NoPE layers: Beam's and Cohere Compass's full-attention layers)
    nope_without_rope_parameters: bool = False
    # the function of the family's modeling module giving those NoPE layers
    # a query scale from the positions (attention_scaling=; Beam's
    # compute_attention_scaling)
    nope_scaling: str | None = None
    # learned absolute position embedding added to the token embeddings (GPT-2)
    positions: str | None = None
    # OPT's positions: by default they count the mask's ones (cumsum(mask) *
    # mask - 1, padding at -1), and the module takes (mask, past, position_ids=)
    positions_from_mask: bool = False
    # linear maps the *Model applies where the embedding width differs from the
    # hidden size: to the embeddings before positions are added, and to the
    # final hidden states after the norm (OPT's; a model may have none)
    project_in: str | None = None
    project_out: str | None = None
    # the *Model may have no final norm (OPT with do_layer_norm_before=False)
    norm_optional: bool = False
    # factor the embeddings are multiplied by (Granite), or a function of the
    # *ForCausalLM giving it (None: no factor; AFMoE's depends on a setting)
    embed_multiplier: str | Callable[[Any], float | None] | None = None
    # whether given inputs_embeds are multiplied too (Granite's are; Falcon-H1
    # multiplies only the token embeddings it looks up)
    multiply_given_embeds: bool = True
    # dropout applied to the embeddings, the given inputs_embeds too
    embed_dropout: str | None = None
    # the same as a rate: an attribute of the *Model (Starcoder2's embedding_dropout)
    embed_dropout_rate: str | None = None
    # a norm the *Model applies to the embeddings before the first block (NanoChat's
    # parameter-free final norm, applied twice)
    embed_norm: str | None = None
    mask_rule: str = FULL
    # every layer's type under FULL (the recurrent linear_attention for Mamba
    # models, whose blocks all get the padding mask)
    every_layer: str = "full_attention"
    # the attention types its *Model builds masks for (LAYER_TYPES)
    layer_kinds: tuple[str, ...] = LAYER_KINDS
    # the config list naming each layer's type (LAYER_TYPES)
    layer_types_key: str = "layer_types"
    # the attention type the model gives each of that list's own names, when
    # it has names of its own (Inkling's "hybrid" layers get the full-attention
    # mask); only those names are then known
    layer_type_kinds: tuple[tuple[str, str], ...] = ()
    # its full-attention layers get the sliding-window mask when
    # config.sliding_window is set (MiniMax's, LAYER_TYPES)
    full_slides_if_window: bool = False
    # the model gives position_ids to its mask functions, which then keep
    # packed sequences apart (False: it never detects packing); where the
    # model's forward can be read, what it does decides (Layout.packs_sequences)
    packed_sequences: bool = True
    # the model always materialises the mask (allow_is_causal_skip=False)
    always_mask: bool = False
    # the config setting giving how many streams of the hidden states the
    # blocks carry (the embeddings repeated: DeepSeek-V4's hyper-connections,
    # hc_mult; None: one)
    hyper_streams: str | None = None
    # a module of the *Model applied to the final hidden states before the
    # norm (DeepSeek-V4's hc_head, which merges the streams)
    head_pre: str | None = None
    # the blocks get the token ids (input_ids=, DeepSeek-V4's hash routing),
    # carried from stage to stage
    block_input_ids: bool = False
    # the model gives every block a dict of the rotary tables of these types
    # (DeepSeek-V4's "main" and "compress"), whatever the block's type
    rotary_dict: tuple[str, ...] = ()
    # Gemma 3n's AltUp: the blocks carry altup_num_inputs streams of the hidden
    # states, stacked first ([streams, batch, sequence, hidden]), made from the
    # embeddings by altup_projections and merged by altup_unembed_projections
    # before the final norm
    altup: bool = False
    # each block returns (hidden states, a value) and the next block gets the
    # value as this keyword (None for the first): the sparse-attention top-k
    # indices that GLM-MoE-DSA's and HY-V4's layers pass on, carried from
    # stage to stage
    chained: str | None = None
    # sliding-window layers may run their SDPA attention over query tiles
    # without the dense mask (models/sliding.py); False where the attention
    # brings a mask of its own (Inkling's relative position biases)
    tiled_sliding: bool = True
    # the model runs layers[: config.num_hidden_layers] (else all of them)
    slices_layers: bool = True
    # a block keyword that gets the 2-D padding mask beside the attention mask
    # (Falcon-H1's blocks run attention and Mamba side by side)
    padding_mask_kwarg: str | None = None
    # the function of the family's modeling module that builds the ALiBi biases
    # every block gets (alibi=) from the 2-D padding mask (Bloom's build_alibi_tensor)
    alibi: str | None = None
    # constant keyword arguments the model gives every block
    block_kwargs: tuple[tuple[str, Any], ...] = ()
    # per-layer embeddings (Gemma 4): the *Model's get_per_layer_inputs and
    # project_per_layer_inputs give every block its slice (per_layer_input=)
    per_layer_inputs: bool = False
    # the config property naming each layer's part in key-value sharing
    # (Gemma 4's kv_sharing_modes: "store" its keys and values, "reuse" an
    # earlier layer's, None): the stored ones are carried to the later stages
    kv_sharing: str | None = None
    # keyword arguments the model gives every block as a dict the blocks write
    # to: each call gets a fresh one (Gemma 4's shared_kv_states), holding
    # what earlier stages stored for this block to read (kv_sharing)
    scratch_kwargs: tuple[str, ...] = ()
    # the final hidden states divided by this before the LM head (MiniCPM3)
    hidden_divisor: str | None = None
    # the LM head's output cast to fp32 before anything else (Nemotron-H, Mamba)
    float_logits: bool = False
    # the final hidden states cast to the LM head's weight dtype (Mamba models,
    # whose blocks keep an fp32 residual stream)
    cast_to_head: bool = False
    # the logits times this (Cohere's logit_scale)
    logit_scale: str | None = None
    # the logits divided by this (Granite's logits_scaling)
    logit_divisor: str | None = None
    # tanh soft-capping of the logits at this value when it is not None (Gemma 2/3)
    logit_softcap: str | None = None
    # the logits cut to this many entries of the vocabulary when it is not
    # None and fewer than the head has (Inkling's unpadded_vocab_size)
    logit_vocab: str | None = None
    router_aux: RouterAux | None = None
    refused: tuple[Setting, ...] = field(default_factory=tuple)
    # the block's per-token feed-forward submodule, run over sequence tiles at
    # long sequences (it must return one tensor); None: never tiled
    mlp: str | None = "mlp"

    def __post_init__(self) -> None:
        if self.mask_rule not in MASK_RULES:
            raise ValueError(f"{self.name}: mask_rule must be one of {MASK_RULES}")

    def module_paths(self, base: str | None = None) -> list[str]:
        """The module attributes, from the ``*ForCausalLM``, this family's
        layout needs (with the decoder at ``base`` instead of the entry's)."""
        rotary = None if self.rotary_optional else self.rotary
        norm = None if self.norm_optional else self.norm
        inner = [self.embed, self.layers, norm, rotary, self.positions]
        inner += [self.embed_dropout, self.embed_norm, self.head_pre]
        base = base or self.base
        return [base, *(f"{base}.{p}" for p in inner if p), self.lm_head]


_MOE = RouterAux()
_GEMMA4: dict[str, Any] = dict(
    mask_rule=LAYER_TYPES,
    rotary_per_layer_type=True,
    scratch_kwargs=("shared_kv_states",),
    per_layer_inputs=True,
    kv_sharing="kv_sharing_modes",
)
_GEMMA3_BIDIRECTIONAL = Setting(
    "use_bidirectional_attention", False, "Gemma3TextModel then overlays bidirectional masks"
)
_NO_CROSS_ATTENTION = Setting(
    "add_cross_attention",
    False,
    "its cross-attention blocks need encoder states the pipeline does not carry",
)
# GPT-2's layout (transformer.wte/h/ln_f, embedding dropout), with a rotary module
_GPT_LAYOUT: dict[str, Any] = dict(
    base="transformer",
    embed="wte",
    layers="h",
    norm="ln_f",
    embed_dropout="drop",
    slices_layers=False,
)


# Mamba language models: backbone.embeddings/layers/norm_f, every block a Mamba
# mixer given the padding mask, no positions, the head's input in its dtype,
# fp32 logits
_MAMBA_LAYOUT: dict[str, Any] = dict(
    base="backbone",
    embed="embeddings",
    norm="norm_f",
    rotary=None,
    every_layer="linear_attention",
    float_logits=True,
    cast_to_head=True,
    slices_layers=False,
    mlp=None,
)


def _mup_multiplier(model: Any) -> float | None:
    """AFMoE multiplies the embeddings by sqrt(hidden_size) when ``mup_enabled``."""
    config = model.config
    return config.hidden_size**0.5 if getattr(config, "mup_enabled", False) else None


def _no_router_loss(cls: str) -> Setting:
    """The refusal for a Mixture-of-Experts model that adds no router loss."""
    return Setting(
        "output_router_logits",
        False,
        f"{cls} adds no router loss, it would only return every router's logits, and the "
        "pipeline returns the loss and logits",
    )


FAMILIES: tuple[Family, ...] = (
    Family("Llama", ("llama",)),
    Family("Qwen2", ("qwen2",), mask_rule=LAYER_TYPES),
    Family("Qwen3", ("qwen3",), mask_rule=LAYER_TYPES),
    Family("Mistral", ("mistral",), mask_rule=SLIDING_IF_WINDOW),
    # the sqrt(hidden_size) scaling is inside Gemma's embedding module (in the
    # embedding dtype), so given inputs_embeds are not scaled, as in the model
    Family("Gemma", ("gemma",)),
    Family(
        "Gemma 2",
        ("gemma2",),
        mask_rule=LAYER_TYPES,
        logit_softcap="config.final_logit_softcapping",
    ),
    Family(
        "Gemma 3",
        ("gemma3_text",),
        mask_rule=LAYER_TYPES,
        rotary_per_layer_type=True,
        logit_softcap="config.final_logit_softcapping",
        refused=(_GEMMA3_BIDIRECTIONAL,),
    ),
    # the multimodal Gemma3ForConditionalGeneration, trained on text: its
    # language model (images, token_type_ids are call arguments, refused);
    # it does not soft-cap the logits
    Family(
        "Gemma 3 (multimodal, text)",
        ("gemma3",),
        base="model.language_model",
        mask_rule=LAYER_TYPES,
        rotary_per_layer_type=True,
        refused=(_GEMMA3_BIDIRECTIONAL,),
    ),
    Family("Phi", ("phi",), norm="final_layernorm", embed_dropout="embed_dropout"),
    Family("Phi-3", ("phi3",), mask_rule=SLIDING_IF_WINDOW),
    Family(
        "GPT-2",
        ("gpt2",),
        base="transformer",
        embed="wte",
        layers="h",
        norm="ln_f",
        rotary=None,
        positions="wpe",
        embed_dropout="drop",
        slices_layers=False,
        refused=(_NO_CROSS_ATTENTION,),
    ),
    Family(
        "GPT-NeoX",
        ("gpt_neox",),
        base="gpt_neox",
        embed="embed_in",
        norm="final_layer_norm",
        embed_dropout="emb_dropout",
        slices_layers=False,
    ),
    Family("OLMo 2", ("olmo2",)),
    Family("Cohere", ("cohere",), logit_scale="logit_scale"),
    Family(
        "Granite",
        ("granite",),
        embed_multiplier="model.embedding_multiplier",
        logit_divisor="config.logits_scaling",
    ),
    Family("StableLM", ("stablelm",), slices_layers=False),
    Family(
        "Falcon",
        ("falcon",),
        base="transformer",
        embed="word_embeddings",
        layers="h",
        norm="ln_f",
        # FalconModel always materialises its mask, built without position_ids
        # before transformers 5.2x (with them since: the layout reads which)
        packed_sequences=False,
        always_mask=True,
        slices_layers=False,
        block_kwargs=(("alibi", None),),
        refused=(
            Setting(
                "alibi",
                False,
                "ALiBi biases are folded into the mask by FalconModel itself, which the "
                "pipeline layers do not reproduce",
            ),
        ),
    ),
    Family("Qwen3-MoE", ("qwen3_moe",), mask_rule=SLIDING_IF_WINDOW, router_aux=_MOE),
    Family("Mixtral", ("mixtral",), mask_rule=SLIDING_IF_WINDOW, router_aux=_MOE),
    Family(
        "GPT-OSS",
        ("gpt_oss",),
        mask_rule=LAYER_TYPES,
        packed_sequences=False,  # GptOssModel builds its masks without position_ids
        slices_layers=False,
        router_aux=_MOE,
        mlp=None,  # its MLP returns (output, router scores)
    ),
    Family("DeepSeek-V3", ("deepseek_v3",), refused=(_no_router_loss("DeepseekV3ForCausalLM"),)),
    # DeepseekV2RotaryEmbedding returns one complex table, which the blocks take as it is
    Family("DeepSeek-V2", ("deepseek_v2",), refused=(_no_router_loss("DeepseekV2ForCausalLM"),)),
    # the families below follow the Llama layout; what differs is in the entry
    Family("OLMo", ("olmo",)),
    Family("OLMo 3", ("olmo3",), mask_rule=LAYER_TYPES, rotary_per_layer_type=True),
    Family("OLMoE", ("olmoe",), router_aux=_MOE),
    Family("FlexOlmo", ("flex_olmo",), router_aux=_MOE),
    Family("Qwen2-MoE", ("qwen2_moe",), mask_rule=LAYER_TYPES, router_aux=_MOE),
    # Starcoder2Model drops out its embeddings with a rate (config.embedding_dropout)
    Family(
        "Starcoder2",
        ("starcoder2",),
        mask_rule=SLIDING_IF_WINDOW,
        embed_dropout_rate="embedding_dropout",
    ),
    Family("SmolLM3", ("smollm3",), mask_rule=LAYER_TYPES),
    Family("GLM", ("glm", "glm4")),
    Family("GLM-4-MoE", ("glm4_moe",), refused=(_no_router_loss("Glm4MoeForCausalLM"),)),
    Family(
        "GLM-4-MoE-Lite",
        ("glm4_moe_lite",),
        refused=(_no_router_loss("Glm4MoeLiteForCausalLM"),),
    ),
    Family("Helium", ("helium",)),
    Family("Ministral", ("ministral",), mask_rule=LAYER_TYPES),
    Family("Ministral 3", ("ministral3",), mask_rule=SLIDING_IF_WINDOW),
    Family(
        "Cohere 2",
        ("cohere2",),
        mask_rule=LAYER_TYPES,
        slices_layers=False,
        logit_scale="logit_scale",
    ),
    Family("EXAONE 4", ("exaone4",), mask_rule=LAYER_TYPES, slices_layers=False),
    Family(
        "EXAONE-MoE",
        ("exaone_moe",),
        mask_rule=LAYER_TYPES,
        refused=(_no_router_loss("ExaoneMoeForCausalLM"),),
    ),
    Family(
        "Granite-MoE",
        ("granitemoe", "granitemoeshared"),
        embed_multiplier="model.embedding_multiplier",
        logit_divisor="config.logits_scaling",
        router_aux=_MOE,
        mlp="block_sparse_moe",  # (GraniteMoeShared's shared_mlp beside it runs whole)
    ),
    Family("MiniMax-M2", ("minimax_m2",), router_aux=_MOE),
    Family("PhiMoE", ("phimoe",), mask_rule=SLIDING_IF_WINDOW, router_aux=_MOE),
    Family("Seed-OSS", ("seed_oss",)),
    Family("ERNIE 4.5", ("ernie4_5",)),
    Family("ERNIE 4.5 MoE", ("ernie4_5_moe",), router_aux=_MOE),
    Family("Hunyuan", ("hunyuan_v1_dense",)),
    Family(
        "Hunyuan-MoE",
        ("hunyuan_v1_moe",),
        refused=(_no_router_loss("HunYuanMoEV1ForCausalLM"),),
    ),
    Family("Apertus", ("apertus",)),
    Family("Arcee", ("arcee",)),
    Family("Nemotron", ("nemotron",), slices_layers=False),
    Family("BitNet", ("bitnet",)),
    Family(
        "VaultGemma",
        ("vaultgemma",),
        mask_rule=LAYER_TYPES,
        logit_softcap="config.final_logit_softcapping",
    ),
    # Llama4TextMoe returns (output, router logits): its feed_forward is never tiled
    Family(
        "Llama 4",
        ("llama4_text",),
        mask_rule=LAYER_TYPES,
        layer_kinds=("full_attention", "chunked_attention"),
        mlp=None,
        refused=(_no_router_loss("Llama4ForCausalLM"),),
    ),
    # hybrids: Gated DeltaNet (linear attention) blocks between attention blocks;
    # the rotary module takes the text positions for all its (multimodal) axes
    Family(
        "Qwen3.5",
        ("qwen3_5_text",),
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
    ),
    Family(
        "Qwen3.5-MoE",
        ("qwen3_5_moe_text",),
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
        router_aux=_MOE,
    ),
    Family(
        "Qwen3-Next",
        ("qwen3_next",),
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
        router_aux=_MOE,
    ),
    Family("Solar Open", ("solar_open",), refused=(_no_router_loss("SolarOpenForCausalLM"),)),
    Family("DiffLlama", ("diffllama",)),
    Family("Jais 2", ("jais2",)),
    Family("Youtu", ("youtu",)),
    Family("CWM", ("cwm",), mask_rule=LAYER_TYPES),
    Family("Persimmon", ("persimmon",), norm="final_layernorm", slices_layers=False),
    Family(
        "HyperCLOVA X",
        ("hyperclovax",),
        embed_multiplier="model.embedding_multiplier",
        logit_scale="config.logits_scaling",
    ),
    # MiniCPM3's embedding module scales by config.scale_emb itself
    Family("MiniCPM3", ("minicpm3",), hidden_divisor="config.logits_scaling"),
    Family(
        "NanoChat",
        ("nanochat",),
        embed_norm="norm",
        logit_softcap="config.final_logit_softcapping",
    ),
    Family(
        "AFMoE",
        ("afmoe",),
        mask_rule=LAYER_TYPES,
        slices_layers=False,
        embed_multiplier=_mup_multiplier,
        refused=(_no_router_loss("AfmoeForCausalLM"),),
    ),
    Family(
        "Doge",
        ("doge",),
        mask_rule=SLIDING_IF_WINDOW,
        always_mask=True,  # DogeModel builds its mask with allow_is_causal_skip=False
        refused=(
            Setting(
                "is_moe",
                False,
                "DogeCDMoE routes each token by router logits mixed across all the tokens of "
                "its input (a view over the whole batch), so micro-batches and sequence tiles "
                "would route tokens differently from the whole batch",
            ),
        ),
    ),
    # JetMoE's attention experts are routed too: every router in a block counts
    Family("JetMoE", ("jetmoe",), router_aux=RouterAux(coef="aux_loss_coef")),
    Family("GPT-J", ("gptj",), **_GPT_LAYOUT),
    Family("CodeGen", ("codegen",), **_GPT_LAYOUT),
    # GPT-Neo's local attention is inside its blocks: one causal mask for all
    Family("GPT-Neo", ("gpt_neo",), **_GPT_LAYOUT, rotary=None, positions="wpe"),
    Family(
        "GPT-BigCode",
        ("gpt_bigcode",),
        **_GPT_LAYOUT,
        rotary=None,
        positions="wpe",
        refused=(_NO_CROSS_ATTENTION,),
    ),
    Family(
        "Mellum", ("mellum",), mask_rule=LAYER_TYPES, rotary_per_layer_type=True, router_aux=_MOE
    ),
    Family(
        "MiMo-V2-Flash",
        ("mimo_v2_flash",),
        mask_rule=LAYER_TYPES,
        rotary_per_layer_type=True,
        refused=(_no_router_loss("MiMoV2FlashForCausalLM"),),
    ),
    Family(
        "Cohere 2 MoE",
        ("cohere2_moe",),
        mask_rule=LAYER_TYPES,
        slices_layers=False,
        logit_scale="logit_scale",
        refused=(_no_router_loss("Cohere2MoeForCausalLM"),),
    ),
    # its sparse-attention indexer needs the causal mask itself: always built
    Family(
        "DeepSeek-V3.2",
        ("deepseek_v32",),
        always_mask=True,
        refused=(_no_router_loss("DeepseekV32ForCausalLM"),),
    ),
    # as Gemma 3; per-layer embeddings and the keys and values layers store
    # for later ones travel with the hidden states, with their gradients
    Family(
        "Gemma 4 (text)",
        ("gemma4_text",),
        logit_softcap="config.final_logit_softcapping",
        refused=(_no_router_loss("Gemma4ForCausalLM"),),
        **_GEMMA4,
    ),
    # the multimodal Gemma4ForConditionalGeneration, trained on text: its
    # language model (images, audio are call arguments, refused)
    Family(
        "Gemma 4 (multimodal, text)",
        ("gemma4",),
        base="model.language_model",
        logit_softcap="model.language_model.config.final_logit_softcapping",
        refused=(_no_router_loss("Gemma4ForConditionalGeneration"),),
        **_GEMMA4,
    ),
    # hyper-connections: the blocks carry hc_mult streams of the hidden states,
    # merged by hc_head before the norm; hash-routed MoE blocks get the token
    # ids; every block gets both rotary tables and the sliding-window mask;
    # eager attention (compressed keys and values, a sparse indexer)
    Family(
        "DeepSeek-V4",
        ("deepseek_v4",),
        every_layer="sliding_attention",
        tiled_sliding=False,
        slices_layers=False,
        hyper_streams="hc_mult",
        head_pre="hc_head",
        block_input_ids=True,
        rotary_dict=("main", "compress"),
        router_aux=_MOE,
        mlp=None,  # (its MoE block takes the token ids too)
    ),
    # DeepSeek-V3.2's layout; layers pass their sparse-attention top-k indices
    # on to the next (which may reuse them)
    Family(
        "GLM-MoE-DSA",
        ("glm_moe_dsa",),
        always_mask=True,
        chained="prev_topk_indices",
        refused=(_no_router_loss("GlmMoeDsaForCausalLM"),),
    ),
    # hyper-connections (as DeepSeek-V4's) with one rotary table, the always
    # built mask for its indexer, top-k indices passed from layer to layer
    Family(
        "HY-V4",
        ("hy_v4",),
        always_mask=True,
        hyper_streams="hc_mult",
        head_pre="hc_head",
        chained="prev_topk_indices",
        cast_to_head=True,
        refused=(_no_router_loss("HYV4ForCausalLM"),),
    ),
    # Gemma 3n: Gemma 3's masks and rotary tables, AltUp streams, per-layer
    # embeddings and key-value sharing (as Gemma 4's), soft-capped logits
    Family(
        "Gemma 3n (text)",
        ("gemma3n_text",),
        logit_softcap="config.final_logit_softcapping",
        altup=True,
        **_GEMMA4,
    ),
    # Gemma 4 Unified: Gemma 4's attention and key-value sharing, without
    # per-layer embeddings or MoE
    Family(
        "Gemma 4 Unified (text)",
        ("gemma4_unified_text",),
        logit_softcap="config.final_logit_softcapping",
        **_GEMMA4,
    ),
    Family(
        "Gemma 4 Unified (multimodal, text)",
        ("gemma4_unified",),
        base="model.language_model",
        logit_softcap="model.language_model.config.final_logit_softcapping",
        **_GEMMA4,
    ),
    # Mamba 2 blocks (which get the padding mask) between attention blocks; no
    # rotary module unless position_embedding_type="rope"
    Family(
        "Granite 4 (GraniteMoeHybrid)",
        ("granitemoehybrid",),
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
        slices_layers=False,
        rotary_optional=True,
        embed_multiplier="model.embedding_multiplier",
        logit_divisor="config.logits_scaling",
        router_aux=_MOE,
        mlp="block_sparse_moe",  # (the shared MLP beside it runs whole)
    ),
    # Kimi Delta Attention blocks (the padding mask) and multi-head latent
    # attention blocks without rotary positions, dense then MoE feed-forwards
    Family(
        "Kimi Linear",
        ("kimi_linear",),
        rotary=None,
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
        refused=(_no_router_loss("KimiLinearForCausalLM"),),
    ),
    Family("Mamba", ("mamba",), **_MAMBA_LAYOUT),
    Family("Mamba 2", ("mamba2",), **_MAMBA_LAYOUT),
    Family("Falcon Mamba", ("falcon_mamba",), **_MAMBA_LAYOUT),
    # attention and Mamba 2 side by side in every block
    Family(
        "Falcon-H1",
        ("falcon_h1",),
        norm="final_layernorm",
        embed_multiplier="model.embedding_multiplier",
        multiply_given_embeds=False,
        logit_scale="model.lm_head_multiplier",
        padding_mask_kwarg="mamba_attention_mask",
        slices_layers=False,
        mlp="feed_forward",
    ),
    # Mamba 2 blocks (which get the padding mask) and attention blocks
    Family(
        "Bamba",
        ("bamba",),
        norm="final_layernorm",
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
        layer_types_key="layers_block_type",
        slices_layers=False,
        mlp="feed_forward",
        refused=(
            Setting(
                "z_loss_coefficient",
                0.0,
                "the z-loss averages over every position of the whole batch, which the "
                "pipeline's per-micro-batch loss does not reproduce",
            ),
        ),
    ),
    # Mamba blocks and attention blocks, MoE feed-forwards, no rotary positions
    Family(
        "Jamba",
        ("jamba",),
        norm="final_layernorm",
        rotary=None,
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
        slices_layers=False,
        router_aux=_MOE,
        mlp="feed_forward",
    ),
    # one mixer per block: Mamba 2 (the padding mask), attention, MLP or MoE
    # (no mask); no rotary positions; fp32 logits
    Family(
        "Nemotron-H",
        ("nemotron_h",),
        embed="embeddings",
        norm="norm_f",
        rotary=None,
        mask_rule=LAYER_TYPES,
        layer_kinds=(*HYBRID_KINDS, *MASKLESS_KINDS),
        layer_types_key="layers_block_type",
        slices_layers=False,
        float_logits=True,
        mlp=None,  # (the mixer is the attention in attention blocks)
        refused=(_no_router_loss("NemotronHForCausalLM"),),
    ),
    # short-convolution blocks (which get the padding mask) and attention
    # blocks; its final norm is called embedding_norm
    Family(
        "LFM2",
        ("lfm2",),
        norm="embedding_norm",
        mask_rule=LAYER_TYPES,
        layer_kinds=("full_attention", "conv"),
        mlp="feed_forward",
    ),
    # Gated DeltaNet blocks between attention blocks (the rotary table is unused by the former)
    Family(
        "OLMo Hybrid",
        ("olmo_hybrid",),
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
        rotary_kinds=("full_attention",),
        slices_layers=False,
    ),
    # lightning-attention blocks (the padding mask) and attention blocks, whose
    # mask slides when config.sliding_window is set; MoE blocks, router loss
    Family(
        "MiniMax",
        ("minimax",),
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
        full_slides_if_window=True,
        slices_layers=False,
        router_aux=_MOE,
    ),
    Family("Flint", ("flint",), mask_rule=LAYER_TYPES, router_aux=_MOE),
    Family(
        "OPT",
        ("opt",),
        base="model.decoder",
        norm="final_layer_norm",
        norm_optional=True,
        rotary=None,
        positions="embed_positions",
        positions_from_mask=True,
        project_in="project_in",
        project_out="project_out",
        slices_layers=False,
        mlp=None,  # (its feed-forward is inline in the block)
        refused=(
            Setting(
                "layerdrop",
                0.0,
                "OPTDecoder skips layers at random while training, which the pipeline's "
                "fixed stages do not",
            ),
        ),
    ),
    # ALiBi biases built from the padding mask, no positions; a norm on the embeddings
    Family(
        "BLOOM",
        ("bloom",),
        base="transformer",
        embed="word_embeddings",
        layers="h",
        norm="ln_f",
        rotary=None,
        embed_norm="word_embeddings_layernorm",
        alibi="build_alibi_tensor",
        slices_layers=False,
        mlp=None,  # (its MLP takes the residual too)
    ),
    Family(
        "Kolibri 1",
        ("kolibri1",),
        mask_rule=LAYER_TYPES,
        refused=(_no_router_loss("Kolibri1ForCausalLM"),),
    ),
    # Gated DeltaNet, sliding-window and full-attention blocks; rotary
    # positions in the sliding-window ones only
    Family(
        "LaraMini",
        ("lara_mini",),
        mask_rule=LAYER_TYPES,
        layer_kinds=(*LAYER_KINDS, "linear_attention"),
        rotary_kinds=("sliding_attention",),
        router_aux=_MOE,
    ),
    Family("Aria (text)", ("aria_text",), refused=(_no_router_loss("AriaTextForCausalLM"),)),
    Family("HY-V3", ("hy_v3",), refused=(_no_router_loss("HYV3ForCausalLM"),)),
    # Granite's scalars, masks per layer_types, one rotary module per rotary
    # base (layer_rope_theta, 0: NoPE layers)
    Family(
        "Granite SWA",
        ("granite_swa",),
        rotary="rotary_embs",
        rotary_by_theta="layer_rope_theta",
        mask_rule=LAYER_TYPES,
        embed_multiplier="model.embedding_multiplier",
        logit_divisor="config.logits_scaling",
    ),
    Family(
        "Granite-MoE SWA",
        ("granitemoe_swa",),
        rotary="rotary_embs",
        rotary_by_theta="layer_rope_theta",
        mask_rule=LAYER_TYPES,
        embed_multiplier="model.embedding_multiplier",
        logit_divisor="config.logits_scaling",
        router_aux=_MOE,
        mlp="block_sparse_moe",  # (the shared MLP beside it runs whole)
    ),
    Family("Apertus 1.5 (text)", ("apertus1p5_text",)),
    Family("Emu3 (text)", ("emu3_text_model",)),
    Family("AX K1", ("axk1",), refused=(_no_router_loss("AXK1ForCausalLM"),)),
    # its sparse-attention indexer needs the causal mask itself: always built
    Family(
        "AX K2",
        ("axk2",),
        always_mask=True,
        refused=(_no_router_loss("AXK2ForCausalLM"),),
    ),
    Family(
        "dots.llm1",
        ("dots1",),
        mask_rule=LAYER_TYPES,
        refused=(_no_router_loss("Dots1ForCausalLM"),),
    ),
    Family(
        "DBRX",
        ("dbrx",),
        base="transformer",
        embed="wte",
        layers="blocks",
        norm="norm_f",
        router_aux=_MOE,
        mlp="ffn",
    ),
    # LFM2's layout with MoE feed-forwards; its rotary module is called pos_emb
    Family(
        "LFM2-MoE",
        ("lfm2_moe",),
        norm="embedding_norm",
        rotary="pos_emb",
        mask_rule=LAYER_TYPES,
        layer_kinds=("full_attention", "conv"),
        mlp="feed_forward",
        refused=(_no_router_loss("Lfm2MoeForCausalLM"),),
    ),
    # LFM2's layout with sliding-window blocks; one rotary table per attention
    # type, none for the short convolutions
    Family(
        "LFM3",
        ("lfm3",),
        norm="embedding_norm",
        mask_rule=LAYER_TYPES,
        layer_kinds=(*LAYER_KINDS, "conv"),
        rotary_per_layer_type=True,
        rotary_kinds=LAYER_KINDS,
        mlp="feed_forward",
    ),
    # linear-attention blocks (the padding mask) between multi-head latent
    # attention blocks; MoE feed-forwards
    Family(
        "Bailing hybrid (Ring/Ling 2.5)",
        ("bailing_hybrid",),
        mask_rule=LAYER_TYPES,
        layer_kinds=HYBRID_KINDS,
        refused=(_no_router_loss("BailingHybridForCausalLM"),),
    ),
    Family(
        "Laguna",
        ("laguna",),
        mask_rule=LAYER_TYPES,
        rotary_per_layer_type=True,
        router_aux=_MOE,
    ),
    Family("MiniMax-M3 (text)", ("minimax_m3_vl_text",), router_aux=_MOE),
    # no positions (relative biases inside the attention); short convolutions
    # inside every block, given the padding mask; the final hidden states
    # divided by the muP width multiplier; the logits cut to the unpadded
    # vocabulary
    Family(
        "Inkling (text)",
        ("inkling_text",),
        rotary=None,
        mask_rule=LAYER_TYPES,
        layer_type_kinds=(("hybrid", "full_attention"), ("hybrid_sliding", "sliding_attention")),
        slices_layers=False,
        padding_mask_kwarg="conv_mask",
        tiled_sliding=False,  # (its attention adds the biases to SDPA's mask)
        hidden_divisor="config.logits_mup_width_multiplier",
        logit_vocab="config.unpadded_vocab_size",
        refused=(_no_router_loss("InklingForCausalLM"),),
    ),
    # multi-head latent attention in sliding-window, full and indexed
    # (sparse) attention blocks, per layer_types; dense and MoE blocks
    Family(
        "Dots3 Note (text)",
        ("dots3_note_text",),
        mask_rule=LAYER_TYPES,
        layer_kinds=(*LAYER_KINDS, *INDEXED_KINDS),
        rotary_per_layer_type=True,
        rotary_fp32_kinds=INDEXED_KINDS,
        refused=(_no_router_loss("Dots3NoteForCausalLM"),),
    ),
    # sliding-window blocks with rotary positions, full-attention NoPE blocks
    # with a query scale growing with the position; fp32 soft-capped logits
    Family(
        "Beam",
        ("beam",),
        mask_rule=LAYER_TYPES,
        rotary_per_layer_type=True,
        nope_without_rope_parameters=True,
        nope_scaling="compute_attention_scaling",
        float_logits=True,
        logit_softcap="config.final_logit_softcapping",
        refused=(_no_router_loss("BeamForCausalLM"),),
    ),
    # its rotary module takes the text positions for all its (multimodal)
    # axes; NoPE layers where rope_parameters has none
    Family(
        "Cohere Compass (text)",
        ("cohere_compass_text",),
        mask_rule=LAYER_TYPES,
        rotary_per_layer_type=True,
        nope_without_rope_parameters=True,
        slices_layers=False,
        logit_scale="logit_scale",
    ),
)

_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def family_for(model_type: Any) -> Family | None:
    """The entry for a ``config.model_type`` (None: not supported)."""
    return _BY_TYPE.get(model_type) if isinstance(model_type, str) else None


#: the families a message names as examples
_EXAMPLES = 6


def supported_families() -> str:
    """The supported families in brief, for messages: how many, a few, and
    where all are (every family with its model types runs to some 3,000
    characters, which buried the rest of a message)."""
    names = list(dict.fromkeys(f.name for f in FAMILIES))
    return (
        f"{len(names)} families, e.g. {', '.join(names[:_EXAMPLES])}; all of them: "
        "lightning_roundpipe.models.FAMILIES, or 'Supported models' in the user guide"
    )
