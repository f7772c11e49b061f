"""The causal-LM adapter over every supported family: each trains under
roundpipe_sync exactly like under the default strategy (padding at both ends,
the two decoder blocks in different stages), and asynchronously; the
Mixture-of-Experts router loss (exact with one micro-batch, the documented
per-micro-batch term otherwise, the whole batch's in evaluation), LoRA on
attention and experts, the model's experts implementation; refusals of what
the pipeline does not implement; the layer-stack choice; ``describe_layers``."""

import contextlib
import copy
import importlib
import math
import sys
import threading

import lightning as L
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_roundpipe import RoundPipeStrategy
from lightning_roundpipe.models import (
    FAMILIES,
    CausalLMAdapter,
    LayerStackNotFound,
    SequentialAdapter,
    find_adapter,
)
from lightning_roundpipe.runtime import RoundPipeEngine

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()  # tiny configs: token ids out of range

VOCAB = 101
SEQ = 10
QUIET = dict(
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
)
LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TOP2 = dict(num_experts_per_tok=2)
SLIDE_FULL = ["sliding_attention", "full_attention"]
# Gated DeltaNet blocks' sizes
HYBRID_LINEAR = dict(
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
# Gated DeltaNet blocks, then attention
HYBRID = dict(head_dim=8, layer_types=["linear_attention", "full_attention"], **HYBRID_LINEAR)
HYBRID_MOE = dict(
    num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16, **TOP2
)
GEMMA3 = dict(LLAMA_LIKE, head_dim=8, sliding_window=4, layer_types=SLIDE_FULL)
GEMMA4 = dict(
    LLAMA_LIKE,
    head_dim=8,
    sliding_window=3,
    layer_types=SLIDE_FULL,
    final_logit_softcapping=2.0,
    hidden_size_per_layer_input=4,  # per-layer embeddings, a slice for each block
    vocab_size_per_layer_input=VOCAB,
    attention_k_eq_v=True,  # the full-attention block's keys are its values
    enable_moe_block=True,  # an MLP and experts beside it in every block
    num_experts=4,
    top_k_experts=2,
    moe_intermediate_size=16,
)


def gemma_multimodal(text: dict) -> dict:
    """A multimodal Gemma 4 config around the tiny ``text`` one: a one-layer
    vision tower, no audio (its text config needs a padding token)."""
    return dict(
        text_config=dict(text, bos_token_id=None, eos_token_id=None, pad_token_id=0),
        vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
        ),
        audio_config=None,
    )


MAMBA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, pad_token_id=None)
MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=4)
# multi-head latent attention (DeepSeek-V3's)
MLA = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8)
IDS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=None)
GPT_LIKE = dict(
    vocab_size=VOCAB,
    n_embd=32,
    n_layer=2,
    n_head=4,
    n_positions=64,
    embd_pdrop=0.0,
    resid_pdrop=0.0,
    attn_pdrop=0.0,
)
GRANITE = dict(embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5)
# model_type -> (config class, model class, settings): tiny, 2 decoder blocks,
# no dropout, and each family's quirk switched on so that it matters
TINY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_LIKE),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(LLAMA_LIKE, use_sliding_window=True, sliding_window=4, max_window_layers=1),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            layer_types=["sliding_attention", "full_attention"],
            use_sliding_window=True,
            sliding_window=3,
        ),
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, sliding_window=4),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, sliding_window=4, final_logit_softcapping=2.0),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(GEMMA3, final_logit_softcapping=2.0),
    ),
    # the multimodal model (a vision tower beside its language model), text only
    "gemma3": (
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        dict(
            text_config=dict(GEMMA3, bos_token_id=None, eos_token_id=None, pad_token_id=None),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
            image_token_id=VOCAB - 1,
            boi_token_index=VOCAB - 2,
            eoi_token_index=VOCAB - 3,
        ),
    ),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(LLAMA_LIKE, embd_pdrop=0.0, resid_pdrop=0.0)),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(LLAMA_LIKE, embd_pdrop=0.0, resid_pdrop=0.0, sliding_window=4, pad_token_id=0),
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", GPT_LIKE),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(LLAMA_LIKE, num_key_value_heads=4, hidden_dropout=0.0),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", LLAMA_LIKE),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(LLAMA_LIKE, logit_scale=0.5)),
    "granite": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(LLAMA_LIKE, embedding_multiplier=2.0, logits_scaling=4.0, residual_multiplier=0.5),
    ),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(LLAMA_LIKE, hidden_dropout=0.0)),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, num_experts=4, moe_intermediate_size=16, **TOP2),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, num_local_experts=4, intermediate_size=16, **TOP2),
    ),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            num_local_experts=4,
            intermediate_size=16,
            sliding_window=4,
            **TOP2,
        ),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            first_k_dense_replace=1,  # block 0 dense, block 1 MoE with a shared expert
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **TOP2,
        ),
    ),
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            head_dim=4,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            **TOP2,
        ),
    ),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(LLAMA_LIKE, clip_qkv=0.5)),
    "olmo3": (
        "Olmo3Config",
        "Olmo3ForCausalLM",
        dict(
            LLAMA_LIKE,
            sliding_window=4,
            layer_types=SLIDE_FULL,
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            },
        ),
    ),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(LLAMA_LIKE, num_experts=4, **TOP2)),
    "flex_olmo": (
        "FlexOlmoConfig",
        "FlexOlmoForCausalLM",
        dict(LLAMA_LIKE, num_experts=4, pad_token_id=0, **TOP2),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            LLAMA_LIKE,
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            use_sliding_window=True,
            sliding_window=4,
            max_window_layers=1,
            **TOP2,
        ),
    ),
    "starcoder2": (
        "Starcoder2Config",
        "Starcoder2ForCausalLM",
        dict(LLAMA_LIKE, sliding_window=4, residual_dropout=0.0, embedding_dropout=0.0),
    ),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(
            LLAMA_LIKE,
            no_rope_layers=[1, 0],
            layer_types=SLIDE_FULL,
            sliding_window=4,
            pad_token_id=0,
        ),
    ),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(LLAMA_LIKE, head_dim=8, pad_token_id=0)),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", dict(LLAMA_LIKE, head_dim=8, pad_token_id=0)),
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            LLAMA_LIKE,
            first_k_dense_replace=1,
            n_routed_experts=4,
            moe_intermediate_size=16,
            use_qk_norm=True,
            **TOP2,
        ),
    ),
    "glm4_moe_lite": (
        "Glm4MoeLiteConfig",
        "Glm4MoeLiteForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            pad_token_id=0,
            **TOP2,
        ),
    ),
    "minimax_m2": (
        "MiniMaxM2Config",
        "MiniMaxM2ForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, num_local_experts=4, **TOP2),
    ),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "ministral": (
        "MinistralConfig",
        "MinistralForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, sliding_window=4, layer_types=SLIDE_FULL),
    ),
    "ministral3": (
        "Ministral3Config",
        "Ministral3ForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, sliding_window=4),
    ),
    "cohere2": (
        "Cohere2Config",
        "Cohere2ForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, sliding_window=4, layer_types=SLIDE_FULL, logit_scale=0.5),
    ),
    "exaone4": (
        "Exaone4Config",
        "Exaone4ForCausalLM",
        dict(LLAMA_LIKE, sliding_window=4, layer_types=SLIDE_FULL),
    ),
    "exaone_moe": (
        "ExaoneMoeConfig",
        "ExaoneMoeForCausalLM",
        dict(
            LLAMA_LIKE,
            sliding_window=4,
            layer_types=SLIDE_FULL,
            mlp_layer_types=["dense", "sparse"],
            first_k_dense_replace=1,
            num_experts=4,
            moe_intermediate_size=16,
            **TOP2,
        ),
    ),
    "granitemoe": (
        "GraniteMoeConfig",
        "GraniteMoeForCausalLM",
        dict(LLAMA_LIKE, num_local_experts=4, **TOP2, **GRANITE),
    ),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        "GraniteMoeSharedForCausalLM",
        dict(LLAMA_LIKE, num_local_experts=4, shared_intermediate_size=16, **TOP2, **GRANITE),
    ),
    "phimoe": (
        "PhimoeConfig",
        "PhimoeForCausalLM",
        # no router jitter: it draws random numbers, which the default strategy draws otherwise
        dict(LLAMA_LIKE, sliding_window=4, num_local_experts=4, router_jitter_noise=0.0, **TOP2),
    ),
    "seed_oss": (
        "SeedOssConfig",
        "SeedOssForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, attention_dropout=0.0, residual_dropout=0.0),
    ),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "ernie4_5_moe": (
        "Ernie4_5_MoeConfig",
        "Ernie4_5_MoeForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            moe_num_experts=4,
            moe_k=2,
            moe_intermediate_size=16,
            moe_num_shared_experts=1,
        ),
    ),
    "hunyuan_v1_dense": (
        "HunYuanDenseV1Config",
        "HunYuanDenseV1ForCausalLM",
        dict(LLAMA_LIKE, head_dim=8),
    ),
    "hunyuan_v1_moe": (
        "HunYuanMoEV1Config",
        "HunYuanMoEV1ForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, num_experts=4, moe_topk=2),
    ),
    "apertus": ("ApertusConfig", "ApertusForCausalLM", LLAMA_LIKE),
    "arcee": ("ArceeConfig", "ArceeForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM", dict(LLAMA_LIKE, head_dim=8)),
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", LLAMA_LIKE),
    "vaultgemma": (
        "VaultGemmaConfig",
        "VaultGemmaForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=4,
            layer_types=SLIDE_FULL,
            final_logit_softcapping=2.0,
        ),
    ),
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            layer_types=["chunked_attention", "full_attention"],
            attention_chunk_size=4,
            no_rope_layers=[1, 0],  # block 1: no rotary, attention temperature tuning
            floor_scale=4,
            intermediate_size=16,
            intermediate_size_mlp=64,
            num_local_experts=4,
            moe_layers=[1],  # block 0 dense, block 1 MoE with a shared expert
        ),
    ),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(LLAMA_LIKE, **HYBRID)),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(LLAMA_LIKE, **HYBRID, **HYBRID_MOE),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(LLAMA_LIKE, **HYBRID, **HYBRID_MOE),
    ),
    "solar_open": (
        "SolarOpenConfig",
        "SolarOpenForCausalLM",
        dict(LLAMA_LIKE, head_dim=8, n_routed_experts=4, moe_intermediate_size=16, **TOP2),
    ),
    "diffllama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", LLAMA_LIKE),
    "jais2": ("Jais2Config", "Jais2ForCausalLM", LLAMA_LIKE),
    "youtu": ("YoutuConfig", "YoutuForCausalLM", dict(LLAMA_LIKE, num_key_value_heads=4, **MLA)),
    "cwm": (
        "CwmConfig",
        "CwmForCausalLM",
        # its config needs token ids
        dict(LLAMA_LIKE, head_dim=8, sliding_window=3, layer_types=SLIDE_FULL, **IDS),
    ),
    "persimmon": (
        "PersimmonConfig",
        "PersimmonForCausalLM",
        dict(LLAMA_LIKE, hidden_dropout=0.0, partial_rotary_factor=0.5),
    ),
    "hyperclovax": (
        "HyperCLOVAXConfig",
        "HyperCLOVAXForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            embedding_multiplier=2.0,
            logits_scaling=0.5,
            residual_multiplier=0.5,
            attention_multiplier=0.25,
        ),
    ),
    "minicpm3": (
        "MiniCPM3Config",
        "MiniCPM3ForCausalLM",
        # logits_scaling = hidden_size / dim_model_base = 2
        dict(LLAMA_LIKE, num_key_value_heads=4, scale_emb=3, dim_model_base=16, **MLA),
    ),
    "nanochat": (
        "NanoChatConfig",
        "NanoChatForCausalLM",
        dict(LLAMA_LIKE, final_logit_softcapping=2.0, **IDS),
    ),
    "afmoe": (
        "AfmoeConfig",
        "AfmoeForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            num_dense_layers=1,  # block 0 dense, block 1 MoE with a shared expert
            num_experts=4,
            num_shared_experts=1,
            moe_intermediate_size=16,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            mup_enabled=True,
            **TOP2,
        ),
    ),
    "doge": (
        "DogeConfig",
        "DogeForCausalLM",
        dict(LLAMA_LIKE, sliding_window=4),
    ),
    "jetmoe": (
        "JetMoeConfig",
        "JetMoeForCausalLM",
        dict(LLAMA_LIKE, kv_channels=8, num_local_experts=4, **TOP2),
    ),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(GPT_LIKE, rotary_dim=4)),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(GPT_LIKE, rotary_dim=4)),
    "gpt_neo": (
        "GPTNeoConfig",
        "GPTNeoForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global", "local"], 1]],  # block 1: local attention
            window_size=4,
            max_position_embeddings=64,
            embed_dropout=0.0,
            resid_dropout=0.0,
            attention_dropout=0.0,
        ),
    ),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", GPT_LIKE),  # multi-query
    "mellum": (
        "MellumConfig",
        "MellumForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            mlp_layer_types=["dense", "sparse"],
            num_local_experts=4,
            moe_intermediate_size=16,
            **TOP2,
        ),
    ),
    "mimo_v2_flash": (
        "MiMoV2FlashConfig",
        "MiMoV2FlashForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            v_head_dim=4,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            n_routed_experts=4,
            moe_intermediate_size=16,
            **TOP2,
        ),
    ),
    "cohere2_moe": (
        "Cohere2MoeConfig",
        "Cohere2MoeForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            num_experts=4,
            moe_intermediate_size=16,
            logit_scale=0.5,
            **TOP2,
        ),
    ),
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            n_routed_experts=4,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            index_topk=4,  # each query attends to 4 keys the indexer picks
            index_n_heads=2,
            index_head_dim=8,
            **MLA,
            **TOP2,
        ),
    ),
    "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM", dict(GEMMA4, pad_token_id=None)),
    # the multimodal model, text only (its text config needs a padding token)
    "gemma4": (
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        gemma_multimodal(GEMMA4),
    ),
    # (eager attention: the model has no sdpa)
    "deepseek_v4": (
        "DeepseekV4Config",
        "DeepseekV4ForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            q_lora_rank=8,
            o_groups=2,
            o_lora_rank=8,
            max_position_embeddings=64,
            hc_mult=2,  # two streams of the hidden states
            hc_sinkhorn_iters=3,
            sliding_window=4,
            layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
            compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
            index_n_heads=2,
            index_head_dim=8,
            index_topk=4,
            mlp_layer_types=["hash_moe", "moe"],  # hash routing by token id, then top-k
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            partial_rotary_factor=0.5,
            num_nextn_predict_layers=0,
            pad_token_id=None,
            **TOP2,
        ),
    ),
    "glm_moe_dsa": (
        "GlmMoeDsaConfig",
        "GlmMoeDsaForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            n_routed_experts=4,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            index_topk=4,  # each query attends to 4 keys the indexer picks
            index_n_heads=2,
            index_head_dim=8,
            indexer_types=["full", "shared"],  # the second block reuses the first's top-k
            **MLA,
            **TOP2,
        ),
    ),
    "hy_v4": (
        "HYV4Config",
        "HYV4ForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            head_dim=8,
            hc_mult=2,  # two streams of the hidden states
            mlp_layer_types=["dense", "sparse"],
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            index_topk=4,
            index_n_heads=2,
            index_head_dim=8,
            indexer_types=["full", "shared"],
            **MLA,
            **IDS,
            **TOP2,
        ),
    ),
    "granite_swa": (
        "GraniteSWAConfig",
        "GraniteSWAForCausalLM",
        dict(
            LLAMA_LIKE,
            **GRANITE,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            layer_rope_theta=[500.0, 0],  # a rotary base of its own, then a NoPE layer
        ),
    ),
    "granitemoe_swa": (
        "GraniteMoeSWAConfig",
        "GraniteMoeSWAForCausalLM",
        dict(
            LLAMA_LIKE,
            **GRANITE,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            layer_rope_theta=[500.0, 0],
            num_local_experts=4,
            shared_intermediate_size=16,
            **TOP2,
        ),
    ),
    "apertus1p5_text": ("Apertus1p5TextConfig", "Apertus1p5TextForCausalLM", LLAMA_LIKE),
    "gemma3n_text": (
        "Gemma3nTextConfig",
        "Gemma3nForCausalLM",
        dict(
            GEMMA3,
            intermediate_size=[64, 64],
            final_logit_softcapping=2.0,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=4,  # per-layer embeddings, a slice for each block
            altup_num_inputs=3,  # three streams of the hidden states
            laurel_rank=4,
            num_kv_shared_layers=0,
            activation_sparsity_pattern=[0.0, 0.0],
            pad_token_id=None,
        ),
    ),
    "gemma4_unified_text": (
        "Gemma4UnifiedTextConfig",
        "Gemma4UnifiedForCausalLM",
        dict(GEMMA3, attention_k_eq_v=True, final_logit_softcapping=2.0, pad_token_id=None),
    ),
    "gemma4_unified": (
        "Gemma4UnifiedConfig",
        "Gemma4UnifiedForConditionalGeneration",
        gemma_multimodal(GEMMA3),
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "GraniteMoeHybridForCausalLM",
        dict(
            LLAMA_LIKE,
            **GRANITE,
            layer_types=["linear_attention", "full_attention"],  # Mamba 2, then attention
            **MAMBA2,
            num_local_experts=4,
            shared_intermediate_size=16,
            **TOP2,
        ),  # no rotary positions (position_embedding_type=None)
    ),
    "kimi_linear": (
        "KimiLinearConfig",
        "KimiLinearForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            **dict(MLA, q_lora_rank=None),
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            linear_head_dim=8,
            linear_num_heads=4,
            num_experts=4,
            moe_intermediate_size=16,
            num_experts_per_token=2,
            pad_token_id=None,
        ),
    ),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(MAMBA_LIKE, state_size=8)),
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(MAMBA_LIKE, num_heads=4, head_dim=16, state_size=8, n_groups=1, chunk_size=4),
    ),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(MAMBA_LIKE, state_size=8)),
    "falcon_h1": (
        "FalconH1Config",
        "FalconH1ForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_head=8,
            mamba_d_state=8,
            mamba_chunk_size=4,
            embedding_multiplier=2.0,
            lm_head_multiplier=0.5,
            pad_token_id=None,
        ),
    ),
    "bamba": (
        "BambaConfig",
        "BambaForCausalLM",
        dict(LLAMA_LIKE, attn_layer_indices=[1], pad_token_id=None, **MAMBA2),
    ),
    "jamba": (
        "JambaConfig",
        "JambaForCausalLM",
        dict(
            LLAMA_LIKE,
            attn_layer_period=2,  # block 0: Mamba and an MLP, block 1: attention and experts
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            mamba_d_state=8,
            mamba_dt_rank=4,
            pad_token_id=None,
            **TOP2,
        ),
    ),
    "nemotron_h": (
        "NemotronHConfig",
        "NemotronHForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            layers_block_type=["linear_attention", "full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=1,
            chunk_size=4,
            max_position_embeddings=64,
            pad_token_id=None,
        ),
    ),
    "lfm2": (
        "Lfm2Config",
        "Lfm2ForCausalLM",
        dict(LLAMA_LIKE, layer_types=["conv", "full_attention"], pad_token_id=None),
    ),
    "minimax": (
        "MiniMaxConfig",
        "MiniMaxForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            sliding_window=3,  # the full-attention block's mask slides
            block_size=4,
            num_local_experts=4,
            pad_token_id=None,
            **TOP2,
        ),
    ),
    "flint": (
        "FlintConfig",
        "FlintForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            mlp_only_layers=[0],  # block 0 dense, block 1 MoE with a shared expert
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            pad_token_id=None,
            **TOP2,
        ),
    ),
    "kolibri1": (
        "Kolibri1Config",
        "Kolibri1ForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            num_local_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            pad_token_id=None,
            **TOP2,
        ),
    ),
    "lara_mini": (
        "LaraMiniConfig",
        "LaraMiniForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            sliding_window=3,
            layer_types=SLIDE_FULL,  # rotary positions in block 0 only
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            pad_token_id=None,
            **TOP2,
        ),
    ),
    "aria_text": (
        "AriaTextConfig",
        "AriaTextForCausalLM",
        dict(
            LLAMA_LIKE, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, pad_token_id=None
        ),
    ),
    "hy_v3": (
        "HYV3Config",
        "HYV3ForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            mlp_layer_types=["dense", "sparse"],
            num_experts=4,
            num_shared_experts=1,
            moe_intermediate_size=16,
            pad_token_id=None,
            **TOP2,
        ),
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            word_embed_proj_dim=16,  # project_in / project_out (OPT-350m's layout)
            pad_token_id=None,
        ),
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        dict(
            vocab_size=VOCAB,
            hidden_size=32,
            n_layer=2,
            n_head=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            pad_token_id=None,
        ),
    ),
    "olmo_hybrid": (
        "OlmoHybridConfig",
        "OlmoHybridForCausalLM",
        dict(LLAMA_LIKE, pad_token_id=None, **HYBRID),
    ),
    "emu3_text_model": (
        "Emu3TextConfig",
        "Emu3ForCausalLM",
        dict(LLAMA_LIKE, attention_dropout=0.0, **dict(IDS, pad_token_id=VOCAB - 1)),
    ),
    "axk1": (
        "AXK1Config",
        "AXK1ForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            mlp_layer_types=["dense", "sparse"],
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            n_group=1,
            topk_group=1,
            **MLA,
            **TOP2,
        ),
    ),
    "axk2": (
        "AXK2Config",
        "AXK2ForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            head_dim=8,
            mlp_layer_types=["dense", "sparse"],
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            index_topk=4,  # each query attends to 4 keys the indexer picks
            index_n_heads=2,
            index_head_dim=8,
            gated_norm_rank=4,
            **MLA,
            **TOP2,
        ),
    ),
    "dots1": (
        "Dots1Config",
        "Dots1ForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            **TOP2,
        ),
    ),
    "dbrx": (
        "DbrxConfig",
        "DbrxForCausalLM",
        dict(
            vocab_size=VOCAB,
            d_model=32,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            # (DbrxAttention reads rope_theta here, as DBRX checkpoints' configs have it)
            attn_config=dict(kv_n_heads=2, clip_qkv=0.5, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=16, moe_num_experts=4, moe_top_k=2),
        ),
    ),
    "lfm2_moe": (
        "Lfm2MoeConfig",
        "Lfm2MoeForCausalLM",
        dict(
            LLAMA_LIKE,
            layer_types=["conv", "full_attention"],
            num_dense_layers=1,
            num_experts=4,
            moe_intermediate_size=16,
            pad_token_id=None,
            **TOP2,
        ),
    ),
    "lfm3": (
        "Lfm3Config",
        "Lfm3ForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            layer_types=["conv", "sliding_attention"],  # rotary positions in the second only
            sliding_window=3,
            **IDS,
        ),
    ),
    "bailing_hybrid": (
        "BailingHybridConfig",
        "BailingHybridForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            head_dim=8,
            layer_types=["linear_attention", "full_attention"],
            mlp_layer_types=["dense", "sparse"],
            num_local_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            n_group=1,
            topk_group=1,
            **dict(MLA, q_lora_rank=None),
            **IDS,
            **TOP2,
        ),
    ),
    "laguna": (
        "LagunaConfig",
        "LagunaForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            num_attention_heads_per_layer=[4, 2],
            mlp_layer_types=["dense", "sparse"],
            num_experts=4,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            **TOP2,
        ),
    ),
    "beam": (
        "BeamConfig",
        "BeamForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            sliding_window=3,
            # rotary positions in the first block, a NoPE query scale in the second
            layer_types=SLIDE_FULL,
            mlp_layer_types=["dense", "sparse"],
            num_experts=4,
            moe_intermediate_size=16,
            n_group=1,
            topk_group=1,
            final_logit_softcapping=2.0,
            **TOP2,
        ),
    ),
    "cohere_compass_text": (
        "CohereCompassTextConfig",
        "CohereCompassForCausalLM",
        dict(
            LLAMA_LIKE,
            sliding_window=3,
            layer_types=SLIDE_FULL,
            # multimodal rotary sections in the sliding-window layers, NoPE full-attention ones
            rope_parameters={
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": 10000.0,
                    "mrope_section": [2, 1, 1],
                },
                "full_attention": None,
            },
            logit_scale=0.5,
            **dict(IDS, pad_token_id=VOCAB - 1),
        ),
    ),
    "inkling_text": (
        "transformers.models.inkling.configuration_inkling.InklingTextConfig",
        "InklingForCausalLM",
        dict(
            LLAMA_LIKE,
            vocab_size=VOCAB + 11,  # a head padded past the vocabulary the logits keep
            unpadded_vocab_size=VOCAB,
            head_dim=8,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=8,
            sliding_window_size=3,
            d_rel=4,  # relative position biases
            rel_extent=16,
            log_scaling_n_floor=4,  # full-attention queries scaled by the position past 4
            layer_types=["hybrid_sliding", "hybrid"],
            mlp_layer_types=["dense", "sparse"],
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            logits_mup_width_multiplier=4.0,
            **TOP2,
        ),
    ),
    # ("Dots3NoteTextConfig" is not exported by transformers: see tiny())
    "dots3_note_text": (
        "transformers.models.dots3_note.configuration_dots3_note.Dots3NoteTextConfig",
        "Dots3NoteForCausalLM",
        dict(
            LLAMA_LIKE,
            num_key_value_heads=4,
            head_dim=8,
            sliding_window=3,
            # multi-head latent attention, narrower in the sliding-window layer
            layer_types=["sliding_attention", "indexed_attention"],
            swa_num_attention_heads=2,
            swa_num_key_value_heads=2,
            swa_q_lora_rank=8,
            swa_kv_lora_rank=8,
            swa_head_dim=8,
            swa_qk_nope_head_dim=4,
            swa_v_head_dim=8,
            index_topk=4,  # each query attends to 4 keys the indexer picks
            index_n_heads=2,
            index_head_dim=8,
            mlp_layer_types=["dense", "sparse"],
            n_routed_experts=4,
            n_shared_experts=1,
            moe_intermediate_size=16,
            shared_experts_intermediate_size=16,
            **MLA,
            **IDS,
            **TOP2,
        ),
    ),
    "minimax_m3_vl_text": (
        "MiniMaxM3VLTextConfig",
        "MiniMaxM3VLForCausalLM",
        dict(
            LLAMA_LIKE,
            head_dim=8,
            rotary_dim=4,
            mlp_layer_types=["dense", "sparse"],
            dense_intermediate_size=64,
            shared_intermediate_size=16,
            num_local_experts=4,
            index_n_heads=2,
            index_head_dim=8,
            index_block_size=2,
            index_topk_blocks=2,
            **IDS,
            **TOP2,
        ),
    ),
}
# Mixture-of-Experts families whose model adds no router loss
NO_ROUTER_LOSS = [
    "deepseek_v3",
    "deepseek_v2",
    "glm4_moe",
    "exaone_moe",
    "hunyuan_v1_moe",
    "solar_open",
    "llama4_text",
    "glm4_moe_lite",
    "afmoe",
    "mimo_v2_flash",
    "cohere2_moe",
    "deepseek_v32",
    "gemma4_text",
    "nemotron_h",
    "kolibri1",
    "aria_text",
    "hy_v3",
    "kimi_linear",
    "axk1",
    "axk2",
    "dots1",
    "lfm2_moe",
    "bailing_hybrid",
    "beam",
    "dots3_note_text",
    "inkling_text",
    "glm_moe_dsa",
    "hy_v4",
]
# families whose model adds a router loss
MOE_AUX = [
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "olmoe",
    "flex_olmo",
    "qwen2_moe",
    "granitemoe",
    "granitemoeshared",
    "phimoe",
    "ernie4_5_moe",
    "qwen3_5_moe_text",
    "qwen3_next",
    "minimax_m2",
    "jetmoe",
    "mellum",
    "granitemoehybrid",
    "jamba",
    "flint",
    "lara_mini",
    "minimax",
    "dbrx",
    "laguna",
    "minimax_m3_vl_text",
    "deepseek_v4",
    "granitemoe_swa",
]


def _transformers_class(name: str) -> type:
    """A class transformers exports, or one named by its module path."""
    if "." not in name:
        return getattr(transformers, name)
    module, _, attr = name.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def tiny(kind: str, **settings) -> nn.Module:
    """A tiny model of the family, random weights (seeded), sdpa attention
    where the family supports it, else eager."""
    config_cls, model_cls, base = TINY[kind]
    config = _transformers_class(config_cls)(
        **{"bos_token_id": None, "eos_token_id": None, **base, **settings}
    )
    cls = _transformers_class(model_cls)
    torch.manual_seed(0)
    try:
        model = cls._from_config(config, attn_implementation="sdpa")
    except ValueError:  # e.g. Gemma 2, GPT-OSS: no sdpa
        torch.manual_seed(0)
        model = cls._from_config(config, attn_implementation="eager")
    for name in ("vision_tower", "multi_modal_projector", "embed_vision"):  # (text only: frozen)
        if hasattr(getattr(model, "model", None), name):
            getattr(model.model, name).requires_grad_(False)
    return model


def lm_data(n: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones_like(ids)
    mask[::3, SEQ - 3 :] = 0  # padding at the right end ...
    mask[1::4, :2] = 0  # ... and at the left end
    return TensorDataset(ids, mask, ids.masked_fill(mask == 0, -100))


# Tiny Gemma 4 trains chaotically at 0.5: plain PyTorch with each batch in two
# halves ends 7e-3 from whole batches after three steps (1.5e-6 at 0.01), so
# the pipeline's micro-batches are compared at a rate where rounding stays small
LEARNING_RATE = {
    kind: 0.01 for kind in ("gemma4_text", "gemma4", "gemma4_unified_text", "gemma4_unified")
}


class LM(L.LightningModule):
    def __init__(self, model: nn.Module, embeds: bool = False) -> None:
        super().__init__()
        self.model = model
        self.embeds = embeds  # call with inputs_embeds= (frozen, computed outside)
        self.losses: list[torch.Tensor] = []
        self.grads_down: list[int] = []

    def training_step(self, batch, batch_idx):
        ids, mask, labels = batch
        if self.embeds:
            with torch.no_grad():
                e = self.model.get_input_embeddings()(ids) + 0.5
            out = self.model(inputs_embeds=e, attention_mask=mask, labels=labels)
        else:
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
        self.losses.append(out.loss.detach().clone())
        return out.loss

    def on_train_batch_end(self, *args) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:  # bytes of weight gradients the devices sent down
            self.grads_down.append(engine.traffic()["grads_down"])

    def configure_optimizers(self):
        # plain SGD: a parameter the step did not use (the embedding when
        # called with inputs_embeds) stays put whether its gradient is None or
        # 0, and a gradient that is zero but for rounding (a key projection's
        # bias) moves its weight by rounding only (Adam would amplify it)
        model_type = getattr(getattr(self.model, "config", None), "model_type", None)
        lr = LEARNING_RATE.get(model_type, 0.5)
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=lr)


def fit(
    module: L.LightningModule,
    strategy,
    devices: int = 1,
    steps: int = 3,
    precision: str = "32-true",
) -> L.Trainer:
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        precision=precision,
        **QUIET,
    )
    trainer.fit(module, DataLoader(lm_data(), batch_size=4))
    return trainer


def sync(microbatches: int = 2, plan: str | None = "2|2|2") -> RoundPipeStrategy:
    """Synchronous; by default embed + block 0 in one stage, block 1 + head
    in the fused stage: the blocks in different stages."""
    return RoundPipeStrategy(async_optimizer=False, num_microbatches=microbatches, plan=plan)


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    # (float32 sums in another order: up to ~2e-5 apart after 3 steps on an
    # AVX2 CPU, in the scaled embeddings of Gemma)
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, atol=5e-5, rtol=1e-4, msg=name)


def trains_like_the_default_strategy(ref: LM, strategy=None, **lm_kwargs) -> LM:
    """``ref`` under "auto" and a copy under roundpipe_sync on 2 CPU workers:
    the same losses and weights, which the steps changed."""
    mod = LM(copy.deepcopy(ref.model), **lm_kwargs)
    before = [p.detach().clone() for p in ref.parameters()]
    fit(ref, "auto")
    fit(mod, strategy or sync(), devices=2)
    torch.testing.assert_close(torch.stack(mod.losses), torch.stack(ref.losses))
    assert_same_weights(mod, ref)
    assert any(not torch.equal(a, b) for a, b in zip(before, ref.parameters(), strict=True))
    return mod


# ------------------------------------------------------------ every family
def test_the_table_covers_every_tested_family():
    assert {t for f in FAMILIES for t in f.model_types} == set(TINY)


@pytest.mark.parametrize("kind", list(TINY))
def test_every_family_trains_like_the_default_strategy(kind):
    trains_like_the_default_strategy(LM(tiny(kind)))


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gemma3_text", "nemotron", "gpt_oss"])
def test_bf16_true_with_one_microbatch_trains_bit_for_bit_like_the_default_strategy(kind):
    """With the module in bf16 and one micro-batch a stage computes what the
    model does, in the same order: three steps give the same bits (all 121
    tested model types but Doge and Inkling did on 2026-11-27: their attention
    masks need a gradient, so SDPA takes another kernel in a forward stage,
    without gradients; with two micro-batches the fp32 sum of the gradients
    rounds otherwise)."""
    model = tiny(kind)
    ref, mod = LM(copy.deepcopy(model)), LM(model)
    fit(ref, "auto", precision="bf16-true")
    fit(mod, sync(microbatches=1), devices=2, precision="bf16-true")
    assert torch.equal(torch.stack(mod.losses), torch.stack(ref.losses))
    for (name, x), y in zip(mod.named_parameters(), ref.parameters(), strict=True):
        assert x.dtype == torch.bfloat16 and torch.equal(x, y), name


@pytest.mark.parametrize("kind", list(TINY))
def test_every_family_trains_asynchronously(kind):
    mod = LM(tiny(kind))
    before = [p.detach().clone() for p in mod.parameters()]
    strategy = RoundPipeStrategy(async_optimizer=True, num_microbatches=2, plan="2|2|2")
    fit(mod, strategy, devices=2)
    assert len(mod.losses) == 3 and all(math.isfinite(float(x)) for x in mod.losses)
    assert any(not torch.equal(a, b) for a, b in zip(before, mod.parameters(), strict=True))


def test_a_hybrid_granite_with_rotary_positions_trains_like_the_default_strategy():
    """GraniteMoeHybrid builds its rotary module for position_embedding_type="rope"
    only (the tiny config has none)."""
    assert tiny("granitemoehybrid").model.rotary_emb is None
    model = tiny("granitemoehybrid", position_embedding_type="rope")
    assert model.model.rotary_emb is not None
    trains_like_the_default_strategy(LM(model))


def test_laramini_linear_attention_and_rotary_only_where_the_model_gives_it():
    """LaraMini's Gated DeltaNet, sliding-window and full-attention blocks,
    the rotary table given to the sliding-window block only."""
    model = tiny(
        "lara_mini",
        num_hidden_layers=3,
        layer_types=["linear_attention", "sliding_attention", "full_attention"],
        **HYBRID_LINEAR,
    )
    trains_like_the_default_strategy(LM(model), sync(plan="3|2|3"))


def test_granite_swa_layers_get_the_rotary_module_of_their_base():
    """Granite SWA builds one rotary module per rotary base and gives each
    layer the one of its base, none for base 0 (NoPE)."""
    bases = [10000.0, 500.0, 0]
    types = [*SLIDE_FULL, "full_attention"]
    model = tiny("granite_swa", num_hidden_layers=3, layer_types=types, layer_rope_theta=bases)
    rotaries = [d.rotary for d in CausalLMAdapter(model, "model").layers()[1:-1]]
    assert [r.config.rope_parameters["rope_theta"] for r in rotaries[:2]] == bases[:2]
    assert rotaries[2] is None
    trains_like_the_default_strategy(LM(model), sync(plan="3|2|3"))


def test_opt_with_its_norms_after_the_blocks_trains_like_the_default_strategy():
    """OPT-350m's settings: layer norms after attention and MLP, so no final
    norm (and no projections without word_embed_proj_dim)."""
    model = tiny("opt", do_layer_norm_before=False, word_embed_proj_dim=32)
    assert model.model.decoder.final_layer_norm is None
    assert model.model.decoder.project_in is None
    trains_like_the_default_strategy(LM(model))


@pytest.mark.parametrize("plan", ["3|3|3", "2,2|2|2,2"])
@pytest.mark.parametrize("kind", ["gemma4_text", "gemma4_unified_text", "gemma3n_text"])
def test_gemma4_keys_and_values_reused_in_later_stages_train_like_the_default_strategy(kind, plan):
    """Gemma 4's (and Gemma 3n's) last layers reuse the keys and values the
    last earlier layer of their type stored: carried, with their gradient,
    from the storing stage to the reusing ones, as are the per-layer
    embeddings' slices (Gemma 4 Unified has none). (One micro-batch: the tiny
    Gemma 4 trains chaotically, and plain PyTorch with the batch split in two
    already ends 2e-5 from whole batches.)"""
    settings = {
        "gemma4_text": {"enable_moe_block": False},
        "gemma3n_text": {"intermediate_size": [64] * 4, "activation_sparsity_pattern": [0.0] * 4},
    }.get(kind, {})
    model = tiny(
        kind, num_hidden_layers=4, layer_types=SLIDE_FULL * 2, num_kv_shared_layers=2, **settings
    )
    assert model.config.kv_sharing_modes == ["store", "store", "reuse", "reuse"]
    adapter = CausalLMAdapter(model, "model")
    assert [d.carries_kv for d in adapter.layers()[1:-1]] == [True, True, True, False]
    ref = LM(model)
    mod = trains_like_the_default_strategy(ref, sync(microbatches=1, plan=plan))
    for (name, a), b in zip(mod.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("kind", ["mamba", "nemotron_h"])
def test_logits_in_fp32_where_the_model_returns_them_so(kind):
    """Mamba's and Nemotron-H's heads cast the logits to fp32 (Mamba's also
    casts its fp32 residual stream to the head's dtype first)."""
    model = tiny(kind).to(torch.bfloat16).eval()
    head = CausalLMAdapter(model, "model").layers()[-1]
    hidden = torch.randn(2, 3, 32, dtype=torch.float32 if kind == "mamba" else torch.bfloat16)
    with torch.no_grad():
        logits = head.project(hidden)
        expected = model.lm_head(model.get_decoder().norm_f(hidden).to(torch.bfloat16)).float()
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, expected)


def test_nemotron_h_mlp_and_moe_blocks_train_like_the_default_strategy():
    """Nemotron-H's four block types (Mamba 2, MoE, attention, MLP), the ones
    without attention given no mask, in three stages."""
    model = tiny(
        "nemotron_h",
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        n_routed_experts=4,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
        num_experts_per_tok=2,
    )
    trains_like_the_default_strategy(LM(model), sync(plan="3|3|3"))


@pytest.mark.parametrize("kind", ["granite", "falcon_h1"])
def test_inputs_embeds_under_the_strategy_train_like_the_default_strategy(kind):
    # Granite's multiplier applies to them too, Falcon-H1's to looked-up tokens only
    ref = LM(tiny(kind), embeds=True)
    trains_like_the_default_strategy(ref, embeds=True)


def test_each_decoder_gets_the_models_mask_type():
    def kinds(model):
        return [layer.kind for layer in CausalLMAdapter(model, "m").layers()[1:-1]]

    full, sliding = "full_attention", "sliding_attention"
    assert kinds(tiny("mistral")) == [sliding, sliding]
    assert kinds(tiny("mistral", sliding_window=None)) == [full, full]
    assert kinds(tiny("qwen2")) == [full, sliding]  # layers >= max_window_layers slide
    assert kinds(tiny("llama", sliding_window=4)) == [full, full]  # LlamaModel never slides
    assert kinds(tiny("gemma3_text")) == [sliding, full]
    assert kinds(tiny("gpt_oss")) == [sliding, full]
    assert kinds(tiny("llama4_text")) == ["chunked_attention", full]
    model = tiny("llama4_text")
    assert [b.is_moe_layer for b in model.model.layers] == [False, True]
    assert [b.self_attn.use_rope for b in model.model.layers] == [True, False]
    assert kinds(tiny("phi3", sliding_window=None)) == [full, full]


@pytest.mark.parametrize(
    "kind", ["gpt2", "falcon", "gpt_oss", "gemma3_text", "phi3", "qwen3_5_text", "llama4_text"]
)
def test_packed_positions_are_treated_as_the_model_treats_them(kind):
    """Positions that restart: GPT-2 and Phi-3 keep the sequences apart (their
    masks get the positions), GPT-OSS only uses them for rotary, and Falcon
    did too before transformers 5.2x (the adapter reads which from the model's
    source: ``test_whether_a_model_keeps_packed_sequences_apart_is_read_from_its_source``);
    Qwen3.5 keeps them apart in its attention blocks, not in its linear-attention
    ones; Llama 4 counts its attention chunks from each sequence's own positions."""
    model = tiny(kind)
    ref = copy.deepcopy(model)
    ids, _, _ = lm_data(4).tensors
    positions = torch.cat([torch.arange(6), torch.arange(4)]).expand(4, -1)
    inputs = dict(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    expected = ref(**inputs).loss
    expected.backward()

    def step():
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach()

    torch.testing.assert_close(attached(model, step, plan="2|2|2"), expected.detach())
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


class _AdamW(LM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_weights_no_gradient_reaches_are_left_alone_by_weight_decay(asynchronous):
    """DeepSeek-V3.2's indexer picks keys by top-k: no gradient reaches its
    weights, whose ``.grad`` autograd leaves None, so AdamW skips them, weight
    decay included. The pipeline does the same (it gave them zeros, and
    AdamW decayed them); the other weights train as under "auto"."""
    model = tiny("deepseek_v32")
    start = copy.deepcopy(model)
    strategy = RoundPipeStrategy(async_optimizer=asynchronous, num_microbatches=2, plan="2|2|2")
    mod = _AdamW(model)
    fit(mod, strategy, devices=2)
    indexer = [n for n, _ in model.named_parameters() if ".indexer." in n]
    assert indexer
    for (name, a), b in zip(model.named_parameters(), start.parameters(), strict=True):
        assert torch.equal(a, b) == (name in indexer), name
    if not asynchronous:  # (one step stale otherwise)
        ref = _AdamW(start)
        fit(ref, "auto")
        torch.testing.assert_close(torch.stack(mod.losses), torch.stack(ref.losses))
        assert_same_weights(mod, ref)


def test_nope_layers_get_the_models_query_scale_from_far_positions():
    """Beam's full-attention layers have no rotary table and scale their
    queries by a slowly growing function of the position (1.0005 at the tiny
    tests' positions, 1.5 here): at far positions the gradients are those of
    the model, and they are not without the scale."""
    model = tiny("beam")
    ref = copy.deepcopy(model)
    ids, _, _ = lm_data(4).tensors
    positions = torch.arange(ids.shape[1]).expand(4, -1) + 100_000
    inputs = dict(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
    expected = ref(**inputs).loss
    expected.backward()

    def step():
        loss = model(**inputs).loss
        loss.backward()
        return loss.detach()

    torch.testing.assert_close(attached(model, step, plan="2|2|2"), expected.detach())
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    scale = sys.modules[type(model).__module__].compute_attention_scaling(positions)
    assert scale.min() > 1.4


def test_packed_chunked_attention_is_refused_on_a_transformers_without_the_remap(monkeypatch):
    """Before transformers 5.23 the masks could not count Llama 4's chunks from
    each packed sequence's own positions: refused, naming the version, before
    anything runs."""
    from transformers import masking_utils

    model = tiny("llama4_text")
    ids, _, _ = lm_data(4).tensors
    positions = torch.cat([torch.arange(6), torch.arange(4)]).expand(4, -1)
    monkeypatch.delattr(masking_utils, "remap_positions_for_packed_sequence")

    def step():
        with pytest.raises(ValueError, match=r"chunked attention need transformers>=5\.23"):
            model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False)
        # with a mask (or unpacked positions) it runs
        return model(input_ids=ids, labels=ids, use_cache=False).loss.detach()

    assert torch.isfinite(attached(model, step, plan="2|2|2"))


def test_whether_a_model_keeps_packed_sequences_apart_is_read_from_its_source():
    from lightning_roundpipe.models.layout import _masks_get_positions

    def create_causal_mask(**kw):
        return None

    create_sliding_window_causal_mask = create_causal_mask

    class Keyword:
        def forward(self, x, position_ids):
            return create_causal_mask(config=None, inputs_embeds=x, position_ids=position_ids)

    class NoneGiven:
        def forward(self, x, position_ids):
            return create_causal_mask(config=None, inputs_embeds=x, position_ids=None)

    class Absent:
        def forward(self, x, position_ids):
            return create_causal_mask(config=None, inputs_embeds=x)

    class InADict:
        def forward(self, x, position_ids):
            kw = {"config": None, "inputs_embeds": x, "position_ids": position_ids}
            return create_sliding_window_causal_mask(**kw)

    class SetLater:
        def forward(self, x, position_ids):
            kw = {"config": None, "inputs_embeds": x}
            kw["position_ids"] = position_ids
            return create_causal_mask(**kw)

    class ChosenHelper:
        def forward(self, x, position_ids, window=None):
            make = create_causal_mask if window is None else create_sliding_window_causal_mask
            return make(config=None, inputs_embeds=x, position_ids=position_ids)

    class NoMask:
        def forward(self, x, position_ids):
            return x

    expected = {
        Keyword: True,
        NoneGiven: False,
        Absent: False,
        InADict: True,
        SetLater: True,
        ChosenHelper: True,
        NoMask: None,
    }
    assert {cls: _masks_get_positions(cls) for cls in expected} == expected
    # the models of this transformers release: all but GPT-OSS's give them
    transformers = pytest.importorskip("transformers")
    assert _masks_get_positions(transformers.GptOssModel) is False
    for name in ("LlamaModel", "GPT2Model", "MistralModel", "Qwen3MoeModel", "Gemma3TextModel"):
        assert _masks_get_positions(getattr(transformers, name)) is True, name


def test_one_dimensional_positions_are_one_row_for_the_whole_batch():
    model = tiny("gpt2").eval()  # GPT-2 takes (sequence) positions
    ids, _, _ = lm_data(4).tensors
    positions = torch.arange(SEQ) + 3
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=positions).logits
        got = attached(model, lambda: model(input_ids=ids, position_ids=positions))
    torch.testing.assert_close(got.logits, expected)


def test_dropout_before_the_first_block_is_the_models_in_evaluation():
    cases = [("phi", dict(embd_pdrop=0.5)), ("gpt2", dict(embd_pdrop=0.5))]
    cases.append(("starcoder2", dict(embedding_dropout=0.5)))  # a rate, not a module
    for kind, rate in cases:
        model = tiny(kind, **rate).eval()
        ids, mask, labels = lm_data(4).tensors
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask, labels=labels)
            got = attached(model, lambda m=model, i=ids, a=mask: m(input_ids=i, attention_mask=a))
        torch.testing.assert_close(got.logits, expected.logits)


def test_an_embedding_dropout_rate_drops_out_while_training_only():
    model = tiny("starcoder2", embedding_dropout=0.5)
    embed = CausalLMAdapter(model, "model").layers()[0]
    ids, _, _ = lm_data(4).tensors
    plain = model.model.embed_tokens(ids).detach()
    torch.manual_seed(0)
    dropped = embed(input_ids=ids)["hidden_states"].detach()
    zeros = (dropped == 0).float().mean()
    assert 0.35 < float(zeros) < 0.65  # the rate, and the rest scaled by 1 / (1 - rate)
    torch.testing.assert_close(dropped[dropped != 0], 2 * plain[dropped != 0])
    model.eval()
    torch.testing.assert_close(embed(input_ids=ids)["hidden_states"], plain)


@pytest.mark.parametrize(
    ("config_cls", "kind"),
    [("ExaoneConfig", "llama"), ("InternLM3Config", "llama"), ("SarvamMoEConfig", "glm4_moe")],
)
def test_a_model_type_that_loads_a_supported_familys_class_is_that_family(config_cls, kind):
    """Model types whose auto class is a supported family's ``*ForCausalLM``
    run that class's code: the pipeline follows the class."""
    config = getattr(transformers, config_cls)(
        **{**TINY[kind][2], "bos_token_id": None, "eos_token_id": None, "pad_token_id": 0}
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert type(model).__name__ == TINY[kind][1] and config.model_type != kind
    assert CausalLMAdapter(model, "model").layout.family.model_types[0] == kind
    trains_like_the_default_strategy(LM(model))
    # a class of the same name outside transformers is not taken for it
    subclass = type(type(model).__name__, (type(model),), {"__module__": "user_models"})
    model.__class__ = subclass
    with pytest.raises(ValueError, match=rf"model_type {config.model_type!r}, which RoundPipe"):
        CausalLMAdapter(model, "model")


@contextlib.contextmanager
def attached_engine(model, devices=2, microbatches=2, **engine_kwargs):
    """The model's adapter attached to an engine on CPU workers for the
    block: yields ``(adapter, engine)``; detached and closed after it."""
    adapter = CausalLMAdapter(model, "model")
    with RoundPipeEngine(adapter.layers(), ["cpu"] * devices, microbatches, **engine_kwargs) as eng:
        adapter.attach(eng)
        try:
            yield adapter, eng
        finally:
            adapter.detach()


def attached(model, fn, devices=2, microbatches=2, plan=None):
    with attached_engine(model, devices, microbatches, plan=plan) as (_, eng):
        out = fn()
        eng.synchronize()
    return out


# ------------------------------------------------------------ Mixture of Experts
@pytest.mark.parametrize("kind", MOE_AUX)
def test_router_loss_with_one_microbatch_trains_like_the_model(kind):
    model = tiny(kind, output_router_logits=True)
    ids, mask, labels = lm_data(4).tensors
    with torch.no_grad():  # the term is there: the test would see it missing
        with_aux = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        model.config.output_router_logits = False
        without = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        model.config.output_router_logits = True
    assert abs(float(with_aux - without)) > 1e-4
    # embed + block 0 | block 1 | head: the statistics cross two boundaries
    trains_like_the_default_strategy(LM(model), sync(microbatches=1, plan="2,1|1|1,2"))


@pytest.mark.parametrize(
    ("kind", "plan"),
    [
        ("llama", "2|2|2|layered"),
        ("qwen3", "1|3|1|layered"),
        ("qwen3_moe", "1,2|1|3|layered"),
        ("llama", "3|1|3|rewalk"),
        ("qwen3_moe", "1,2|1|3|rewalk"),
    ],
)
def test_layered_stages_train_like_the_default_strategy(kind, plan):
    """Stages that recompute and differentiate one layer at a time (a plan
    for too little host memory), keeping their layers' inputs or computing
    each again (rewalk): the same losses and weights, the router
    loss's statistics crossing layers inside such a stage too (one
    micro-batch: the router loss of several is each one's own term)."""
    if kind in MOE_AUX:
        model, microbatches = tiny(kind, output_router_logits=True), 1
    else:
        model, microbatches = tiny(kind), 2
    trains_like_the_default_strategy(LM(model), sync(microbatches=microbatches, plan=plan))


def test_router_loss_of_several_microbatches_is_each_microbatchs_weighted_term():
    model = tiny("qwen3_moe", output_router_logits=True)
    ref = copy.deepcopy(model)
    ids, mask, labels = lm_data(4).tensors
    # the documented semantics: the model's loss (cross-entropy + router term)
    # of each micro-batch, weighted by its share of the labelled tokens
    counts = [int((y[:, 1:] != -100).sum()) for y in labels.tensor_split(2)]
    expected = sum(
        ref(input_ids=i, attention_mask=m, labels=y).loss * (c / sum(counts))
        for i, m, y, c in zip(
            ids.tensor_split(2), mask.tensor_split(2), labels.tensor_split(2), counts, strict=True
        )
    )
    expected.backward()

    def step():
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach()

    torch.testing.assert_close(attached(model, step, plan="2|2|2"), expected.detach())
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


@pytest.mark.parametrize("kind", MOE_AUX)
def test_router_loss_in_evaluation_is_the_whole_batchs(kind):
    model = tiny(kind, output_router_logits=True).eval()
    ids, mask, labels = lm_data(4).tensors
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, labels=labels)
        got = attached(model, lambda: model(input_ids=ids, attention_mask=mask, labels=labels))
        # called with output_router_logits=False: no term, as the model
        off = attached(
            model,
            lambda: model(input_ids=ids, attention_mask=mask, output_router_logits=False),
        )
    torch.testing.assert_close(got.aux_loss, expected.aux_loss)
    torch.testing.assert_close(got.loss, expected.loss)
    torch.testing.assert_close(got.logits, expected.logits)
    assert off.aux_loss is None


def test_lora_on_attention_and_experts_trains_like_the_default_strategy():
    peft = pytest.importorskip("peft")
    model = tiny("qwen3_moe", output_router_logits=True)
    torch.manual_seed(1)
    config = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    )
    model = peft.get_peft_model(model, config)
    with torch.no_grad():  # LoRA B starts at zero: make every adapter matter at once
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    assert any("experts" in n for n, p in model.named_parameters() if p.requires_grad)
    mod = trains_like_the_default_strategy(LM(model), sync(microbatches=1))
    for name, p in mod.model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[name]), name
    # frozen weights (experts, router, attention) send no gradient down
    trainable = sum(p.numel() for p in mod.parameters() if p.requires_grad)
    assert mod.grads_down and set(mod.grads_down) == {4 * trainable}


def test_a_peft_causal_lm_task_model_trains_like_the_default_strategy():
    """``LoraConfig(task_type="CAUSAL_LM")`` wraps the model in
    ``PeftModelForCausalLM``, which passes ``return_dict=None``: the config's
    setting, as transformers reads it (it was taken as ``False``: a tuple
    came back and ``.loss`` failed)."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny("llama"), config)
    assert isinstance(model, peft.PeftModelForCausalLM)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    trains_like_the_default_strategy(LM(model))
    ids, mask, _ = lm_data(4).tensors
    plain = tiny("llama")
    with torch.no_grad():
        expected = plain(input_ids=ids, attention_mask=mask, return_dict=None)
        got = attached(plain, lambda: plain(input_ids=ids, attention_mask=mask, return_dict=None))
        as_tuple = attached(plain, lambda: plain(input_ids=ids, return_dict=False))
    torch.testing.assert_close(got.logits, expected.logits)
    assert isinstance(as_tuple, tuple)


def test_peft_adaption_prompt_runs_in_the_pipeline_like_the_default_strategy():
    """PEFT's AdaptionPrompt (LLaMA-Adapter) keeps the model's forward as its
    own attribute (``self.forward = model.forward``), taken before the
    strategy routes the model's calls to the pipeline: the whole model ran on
    the loop's thread (sync), or was refused (async). The wrapper is pointed
    at the pipeline too, and put back afterwards."""
    peft = pytest.importorskip("peft")
    config = peft.AdaptionPromptConfig(adapter_len=4, adapter_layers=1, task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny("llama"), config)
    assert "forward" in model.base_model.__dict__
    with torch.no_grad():  # the gates start at zero: make the prompts matter at once
        for name, p in model.named_parameters():
            if "adaption_gate" in name:
                p.fill_(0.5)
    mod = trains_like_the_default_strategy(LM(model))
    assert mod.grads_down and all(mod.grads_down)  # the adapters' gradients came down
    wrapper = mod.model.base_model  # (the copy that ran in the pipeline)
    assert wrapper.forward.__self__ is wrapper.model  # put back
    assert wrapper.forward.__func__ is type(wrapper.model).forward


@pytest.mark.parametrize("feature", ["adapter_names", "alora"])
def test_peft_per_sample_arguments_are_refused_with_what_to_do(feature):
    """PEFT hands every adapted layer values for each sample of the whole
    batch (a mixed-adapter batch's ``adapter_names=``, activated LoRA's
    offsets) through hooks; per micro-batch they failed inside a worker with
    PEFT's own length or shape error."""
    peft = pytest.importorskip("peft")
    extra = {"alora_invocation_tokens": [5]} if feature == "alora" else {}
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], task_type="CAUSAL_LM", **extra
    )
    model = peft.get_peft_model(tiny("llama"), config)
    model.add_adapter("b", peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    model.eval()  # (PEFT takes adapter_names= in evaluation only)
    ids, mask, _ = lm_data(4).tensors
    ids[:, 3] = 5  # the invocation token: activated LoRA adapts what follows it
    kwargs = {"adapter_names": ["default", "b"] * 2} if feature == "adapter_names" else {}
    what = "adapter_names=" if feature == "adapter_names" else "activated LoRA"
    refused = pytest.raises(ValueError, match=f"PEFT's {what}.*model.set_adapter")
    with torch.no_grad(), attached_engine(model.get_base_model()), refused:
        model(input_ids=ids, attention_mask=mask, **kwargs)


@pytest.mark.parametrize("kind", ["mixtral", "solar_open"])
def test_lora_on_experts_with_stages_on_two_threads_trains_like_the_default_strategy(kind):
    """PEFT's LoRA on the experts' parameters (chosen by "all-linear" for
    Mixture-of-Experts models) opens torch's parametrization cache in every
    forward; with two micro-batches both workers run adapted layers at once.
    With torch's process-wide cache a worker's next forward sometimes found
    the weights and freed graph of the one before (about one fit in six
    under load: "Trying to backward through the graph a second time", or
    other weights); the cache is per thread now (runtime/parametrize.py)."""
    peft = pytest.importorskip("peft")
    model = tiny(kind)
    torch.manual_seed(1)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    assert any("experts" in n and "lora_" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    for _ in range(3):
        trains_like_the_default_strategy(LM(copy.deepcopy(model)), sync(microbatches=2))


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_lora_on_experts_with_tiled_blocks_trains_like_the_default_strategy(kind):
    """A tiled block recomputes its tiles in its backward, each calling the
    router and then PEFT's expert adapters, which re-register a
    parametrization (an in-place write to the expert weights). The stage's
    weights are views of one uploaded buffer: sharing its version counter,
    the router weight the router's product saved looked modified, and the
    backward failed. Each weight now has its own counter."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    model = peft.get_peft_model(
        tiny(kind), peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    assert any("experts" in n and "lora_" in n for n, _ in model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    strategy = RoundPipeStrategy(
        async_optimizer=False, num_microbatches=2, plan="2|2|2", tile_memory=1
    )
    trains_like_the_default_strategy(LM(model), strategy)


def test_the_pipeline_runs_the_models_experts_implementation(monkeypatch):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model = tiny("qwen3_moe")
    assert model.config._experts_implementation == "grouped_mm"
    threads: list[str] = []
    grouped = ALL_EXPERTS_FUNCTIONS["grouped_mm"]

    def counting(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return grouped(*args, **kwargs)

    monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS, "grouped_mm", counting)
    ids, mask, labels = lm_data(4).tensors

    def step():
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()

    attached(model, step, plan="2|2|2")
    main = threading.current_thread().name
    # 2 micro-batches x 2 MoE blocks x (forward + recompute) of block 0; block 1 once each
    assert len(threads) == 6 and main not in threads
    threads.clear()
    model.set_experts_implementation("eager")
    attached(model, step, plan="2|2|2")
    assert threads == []


# ------------------------------------------------------------ refusals
def test_an_unimplemented_config_setting_is_refused_naming_it():
    cases = [
        (
            "gpt2",
            dict(add_cross_attention=True),
            r"config\.add_cross_attention=True .*"
            r"set config\.add_cross_attention=False",
        ),
        ("falcon", dict(alibi=True), r"config\.alibi=True is not supported.*ALiBi"),
        (
            "gemma3_text",
            dict(use_bidirectional_attention=True),
            r"config\.use_bidirectional_attention=True is not supported",
        ),
        *(
            (
                kind,
                dict(output_router_logits=True),
                r"config\.output_router_logits=True is not supported.*adds no router loss",
            )
            for kind in NO_ROUTER_LOSS
        ),
        ("llama", dict(is_causal=False), r"config\.is_causal=False is not supported"),
        ("doge", dict(is_moe=True), r"config\.is_moe=True is not supported.*whole batch"),
        ("opt", dict(layerdrop=0.1), r"config\.layerdrop=0\.1 is not supported.*at random"),
        (
            "gemma4_text",
            dict(use_bidirectional_attention="all"),  # (which sets is_causal=False)
            r"config\.is_causal=False is not supported.*bidirectional masks",
        ),
    ]
    for kind, settings, match in cases:
        with pytest.raises(ValueError, match=r"^model: " + match):
            CausalLMAdapter(tiny(kind, **settings), "model")


def test_config_settings_the_pipeline_does_not_implement_are_refused():
    model = tiny("qwen3")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(
        ValueError,
        match=r"config\._attn_implementation='flex_attention' is not supported.*"
        r"attn_implementation='sdpa'",
    ):
        CausalLMAdapter(model, "model")

    model = tiny("qwen3", layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(
        ValueError,
        match=r"model: config\.layer_types\[1\]='chunked_attention' is not supported by the "
        r"RoundPipe pipeline: Qwen3Model builds 'full_attention' and 'sliding_attention' masks",
    ):
        CausalLMAdapter(model, "model")
    # a family with layer-type names of its own knows those only (Inkling would
    # give a "full_attention" layer the sliding-window mask)
    model = tiny("inkling_text", layer_types=["hybrid", "full_attention"])
    with pytest.raises(
        ValueError,
        match=r"config\.layer_types\[1\]='full_attention' is not supported by the RoundPipe "
        r"pipeline: InklingTextModel builds 'hybrid' and 'hybrid_sliding' masks only",
    ):
        CausalLMAdapter(model, "model")

    model = tiny("llama")
    model.config.output_hidden_states = True
    with pytest.raises(ValueError, match=r"config\.output_hidden_states=True is not supported"):
        CausalLMAdapter(model, "model")

    model = tiny("llama")
    model.config.num_hidden_layers = 1
    with pytest.raises(ValueError, match=r"config\.num_hidden_layers=1, but the model holds 2"):
        CausalLMAdapter(model, "model")
    # GPT-2 runs every block it holds, whatever the config says
    model = tiny("gpt2")
    model.config.num_hidden_layers = 1
    assert CausalLMAdapter(model, "model").describe_layers() == "0 embed, 1-2 blocks, 3 head"

    model = tiny("llama")
    model.model.register_forward_hook(lambda *a: None)
    with pytest.raises(ValueError, match="LlamaModel has forward hooks"):
        CausalLMAdapter(model, "model")
    # found automatically, the same refusal
    model.model._forward_hooks.clear()
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match=r"^model: config\._attn_implementation"):
        find_adapter(LM(model))


def test_call_arguments_and_uses_the_pipeline_does_not_implement_are_refused():
    ids, mask, _ = lm_data(4).tensors
    gemma3 = tiny("gemma3")  # the multimodal model trains on text only
    with pytest.raises(TypeError, match=r"arguments \['pixel_values'\] are not supported"):
        attached(gemma3, lambda: gemma3(ids, pixel_values=torch.zeros(4, 3, 28, 28)))
    gpt2 = tiny("gpt2")
    with pytest.raises(TypeError, match=r"arguments \['token_type_ids'\] are not supported"):
        attached(gpt2, lambda: gpt2(ids, token_type_ids=torch.zeros_like(ids)))
    # GPT-2's second positional argument is its key-value cache (past_key_values,
    # renamed cache in transformers 5.2x), bound as the model binds it
    with pytest.raises(TypeError, match=r"(past_key_values|cache) is not supported"):
        attached(gpt2, lambda: gpt2(ids, object()))
    for arg in ("past_key_values", "cache"):  # either name, by keyword
        with pytest.raises(
            TypeError,
            match=rf"{arg} is not supported .* without {arg}, e\.g\. generate\(\.\.\., "
            r"use_cache=False\) during a fit",
        ):
            attached(gpt2, lambda arg=arg: gpt2(ids, **{arg: object()}))
    # asking for a cache back: the pipeline returns none, and a decoding loop
    # feeding it back would compute its next token without the context
    with pytest.raises(TypeError, match=r"use_cache=True asks for a key-value cache back"):
        attached(gpt2, lambda: gpt2(ids, use_cache=True))
    gpt2.config.use_cache = True  # the config's setting (the default) is fine: no cache back
    assert attached(gpt2, lambda: gpt2(ids, use_cache=False).past_key_values) is None
    assert attached(gpt2, lambda: gpt2(ids).past_key_values) is None
    # a MoE model without a router loss would return the routers' logits
    for kind in NO_ROUTER_LOSS:
        moe = tiny(kind)
        with pytest.raises(
            TypeError,
            match=r"output_router_logits=True is not supported by the RoundPipe pipeline: "
            r"\w+ForCausalLM adds no router loss.* without output_router_logits$",
        ):
            attached(moe, lambda m=moe: m(input_ids=ids, output_router_logits=True))
    # on a dense model the argument means nothing, to the model as to the pipeline
    llama = tiny("llama").eval()
    with torch.no_grad():
        expected = llama(input_ids=ids, attention_mask=mask).logits
        got = attached(llama, lambda: llama(ids, attention_mask=mask, output_router_logits=True))
    torch.testing.assert_close(got.logits, expected)
    moe = tiny("mixtral", output_router_logits=True)
    with pytest.raises(
        ValueError,
        match=r"output_router_logits=True while training without labels= is not supported.*"
        r"set output_router_logits=False",
    ):
        attached(moe, lambda: moe(input_ids=ids, attention_mask=mask).logits.sum().backward())


class Holder(L.LightningModule):
    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        for name, child in children.items():
            setattr(self, name, child)


def xglm() -> nn.Module:
    """A decoder-only LM of a family RoundPipe does not support."""
    cfg = transformers.XGLMConfig(
        vocab_size=VOCAB,
        d_model=32,
        ffn_dim=64,
        num_layers=2,
        attention_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.XGLMForCausalLM(cfg)


def test_an_unknown_family_is_refused_naming_where_the_supported_ones_are():
    with pytest.raises(LayerStackNotFound) as err:
        find_adapter(Holder(lm=xglm()))
    message = str(err.value)
    assert message.startswith(
        "no layer stack found in Holder: 'lm' is a Hugging Face model with model_type 'xglm', "
        "which RoundPipe does not support (supported: "
        f"{len({f.name for f in FAMILIES})} families, e.g. Llama, Qwen2,"
    )
    assert "lightning_roundpipe.models.FAMILIES, or 'Supported models'" in message
    assert len(message) < 600, message
    assert "layers=" not in message  # naming it would not help
    with pytest.raises(LayerStackNotFound, match=r"^layers='lm' is a Hugging Face model with "):
        find_adapter(Holder(lm=xglm()), layers="lm")


def test_a_known_family_laid_out_otherwise_is_refused_naming_what_is_missing():
    model = tiny("gpt2")
    del model.transformer.wpe
    with pytest.raises(
        LayerStackNotFound,
        match=r"'lm' is a GPT2LMHeadModel \(model_type 'gpt2'\) whose layout RoundPipe cannot "
        r"follow: the GPT-2 entry needs the submodules transformer, transformer\.wte, "
        r"transformer\.h, transformer\.ln_f, transformer\.wpe, transformer\.drop, lm_head, and "
        r"transformer\.wpe is missing \(found: transformer, lm_head; in transformer: wte, drop, "
        r"h, ln_f\)",
    ) as err:
        find_adapter(Holder(lm=model))
    assert "layers=" not in str(err.value)
    model = tiny("llama")
    model.model.layers = nn.Sequential(*model.model.layers)
    with pytest.raises(ValueError, match=r"needs model\.layers to be an nn\.ModuleList of decoder"):
        CausalLMAdapter(model, "model")
    base = tiny("llama").model  # a LlamaModel: no LM head
    with pytest.raises(
        LayerStackNotFound,
        match=r"'base' is a LlamaModel \(model_type 'llama'\) without an LM head; .*pass the "
        r"Llama model with its head \(its \*ForCausalLM class",
    ) as err:
        find_adapter(Holder(base=base))
    assert len(str(err.value)) < 600  # (it listed all the supported families)
    # (another task head: test_classifier.py's test_models_with_another_task_head_are_refused)


def mlp(width: int, depth: int = 2) -> nn.Sequential:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def test_layers_is_suggested_only_for_a_sequential():
    root = Holder(lm=xglm(), head=nn.Sequential(nn.Linear(VOCAB, 2)))
    with pytest.raises(
        LayerStackNotFound,
        match=r"the largest candidate, 'head' \(Sequential, 204 parameters, 1%\), holds at most "
        r"half of its 20,588 parameters; 'lm' \(XGLMForCausalLM, 20,384 parameters, 99%\) would "
        r"run outside the pipeline\. 'lm' is a Hugging Face model with model_type 'xglm', which "
        r"RoundPipe does not support \(supported: .*\), so it cannot be pipelined; train it "
        r"with another strategy, or pass layers='head' to RoundPipeStrategy to pipeline only "
        r"'head'$",
    ):
        find_adapter(root)
    # asked for explicitly, the small stack is pipelined
    assert isinstance(find_adapter(root, layers="head"), SequentialAdapter)
    # a big module outside that is not a language model
    root = Holder(body=nn.ModuleDict({"a": nn.Linear(64, 64)}), head=mlp(4))
    with pytest.raises(
        LayerStackNotFound,
        match=r"'body' \(ModuleDict, 4,160 parameters, 99%\) would run outside the pipeline\. "
        r"RoundPipe pipelines an nn.Sequential or a Hugging Face decoder-only causal LM.*put the "
        r"layers of 'body' in an nn.Sequential, or pass layers='head'",
    ):
        find_adapter(root)
    # nothing to pipeline and no language model: an nn.Sequential, and layers= for one
    with pytest.raises(
        LayerStackNotFound,
        match=r"no layer stack found in Holder: looked for .*\(searched: body\)\. Pass "
        r"layers='attribute.path' to RoundPipeStrategy only for such a module that is not a "
        r"registered submodule; otherwise put the layers to pipeline in an nn.Sequential$",
    ):
        find_adapter(Holder(body=nn.Linear(4, 4)))
    with pytest.raises(LayerStackNotFound, match=r"layers='body' is a Linear; .*nn.Sequential$"):
        find_adapter(Holder(body=nn.Linear(4, 4)), layers="body")


class _Looped(nn.Module):
    """A stack kept in an nn.ModuleList (or nn.ModuleDict) of nn.Sequential
    blocks, which its forward loops over."""

    def __init__(self, n: int, container: type = nn.ModuleList, head: bool = False) -> None:
        super().__init__()
        blocks = [mlp(8) for _ in range(n)]
        if container is nn.ModuleDict:
            self.blocks = nn.ModuleDict({f"b{i}": b for i, b in enumerate(blocks)})
        else:
            self.blocks = container(blocks)
        self.head = nn.Linear(8, 2) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dict_ = isinstance(self.blocks, nn.ModuleDict)
        for block in self.blocks.values() if dict_ else self.blocks:
            x = block(x)
        return x if self.head is None else self.head(x)


@pytest.mark.parametrize(
    ("n", "container", "head", "first", "shares"),
    [
        (4, nn.ModuleList, False, "0", ("25%", "100%")),
        (2, nn.ModuleList, True, "0", ("47%", "94%")),
        (3, nn.ModuleDict, False, "b0", ("33%", "100%")),
    ],
)
def test_a_stack_in_a_module_list_is_named_not_one_of_its_blocks(n, container, head, first, shares):
    """(The refusal suggested layers='model.blocks.0': one block, pipelined
    alone.) It names the container and says to make the stack one
    nn.Sequential; so made, the whole stack is found."""
    root = Holder(model=_Looped(n, container, head))
    kind = container.__name__
    total = n * 144 + (18 if head else 0)
    with pytest.raises(LayerStackNotFound) as err:
        find_adapter(root)
    assert str(err.value) == (
        f"the layer stack of Holder is not clear: the largest candidate, 'model.blocks.{first}' "
        f"(Sequential, 144 parameters, {shares[0]}), is one of {n} blocks of 'model.blocks' "
        f"({kind}, {n * 144:,} parameters, {shares[1]}) and holds at most half of Holder's "
        f"{total:,} parameters. An nn.{kind} is not a stack RoundPipe can pipeline, and "
        f"layers='model.blocks.{first}' would pipeline that block alone: make 'model.blocks' "
        "one nn.Sequential of its blocks (nn.Sequential(*blocks), called as "
        "self.model.blocks(x) instead of a loop over them), or pass layers= naming an "
        "nn.Sequential that holds the whole stack"
    )
    blocks = root.model.blocks
    root.model.blocks = nn.Sequential(*(blocks.values() if kind == "ModuleDict" else blocks))
    adapter = find_adapter(root)
    assert isinstance(adapter, SequentialAdapter) and adapter.target is root.model.blocks


def test_the_refusals_name_a_few_supported_families_and_where_all_are():
    """(Each embedded all of them, some 3,000 characters.)"""
    families = f"{len({f.name for f in FAMILIES})} families, e.g. Llama, Qwen2, "
    where = (
        "all of them: lightning_roundpipe.models.FAMILIES, or 'Supported models' in the user guide"
    )
    root = Holder(body=nn.ModuleDict({"a": nn.Linear(64, 64)}), head=mlp(4))
    for make in (
        lambda: find_adapter(root),
        lambda: find_adapter(Holder(body=nn.Linear(4, 4))),
        lambda: find_adapter(Holder(body=nn.Linear(4, 4)), layers="body"),
    ):
        with pytest.raises(LayerStackNotFound) as err:
            make()
        message = str(err.value)
        assert families in message and where in message, message
        assert len(message) < 600, message
        assert "GPT-NeoX" not in message


def test_the_layer_stack_of_a_family_is_found_by_its_entry():
    for kind, path in (("gpt2", "lm.transformer.h"), ("gpt_neox", "lm.gpt_neox.layers")):
        root = Holder(lm=tiny(kind), proj=nn.Sequential(nn.Linear(4, 4)))
        assert find_adapter(root).target is root.lm
        assert find_adapter(root, layers=path).target is root.lm


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
    lm = tiny("qwen3")
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
    assert CausalLMAdapter(tiny("llama", num_hidden_layers=3), "m").describe_layers() == (
        "0 embed, 1-3 blocks, 4 head"
    )
    assert CausalLMAdapter(tiny("falcon", num_hidden_layers=1), "m").describe_layers() == (
        "0 embed, 1 block, 2 head"
    )
