"""Model presets. Sources are named per family; every row is a published configuration."""

_GPT3 = {"seq": 2048, "vocab": 50257}
_SC21 = {"seq": 2048, "vocab": 51200}
_LLAMA2 = {"seq": 4096, "vocab": 32000, "gated_mlp": True, "tied_embeddings": False, "bias": False,
           "norm": "rmsnorm", "learned_positions": False, "dropout": False}
# Today's decoders: SwiGLU, RMSNorm, rotary positions, no dropout. seq is the training sequence of
# the published runs (../shared/reference/published.md section 7: 4096), not the checkpoints'
# max_position_embeddings (40,960 for Qwen3, 131,072 for GPT-OSS, 163,840 for DeepSeek-V3).
_MODERN = {"seq": 4096, "activation": "swiglu", "tied_embeddings": False, "bias": False, "norm": "rmsnorm",
           "learned_positions": False, "dropout": False}
_QWEN3 = {**_MODERN, "vocab": 151936, "head_dim": 128, "qk_norm": True}
_GPT_OSS = {**_MODERN, "vocab": 201088, "hidden": 2880, "heads": 64, "kv_heads": 8, "head_dim": 64, "ffn": 2880,
            "expert_ffn": 2880, "topk": 4, "bias": True, "attention_sinks": True, "window": 128, "window_every": 2}


def _rows(family: dict, rows: dict) -> dict:
    return {name: {**family, **row} for name, row in rows.items()}


PRESETS: dict[str, dict] = {
    # GPT-3 (Brown et al. 2020, Table 2.1). The table's XL and 13B rows are not self-consistent
    # (24 heads x 128 != 2048; 40 x 128 != 5140): we keep d_head = 128 and use 16 heads and 5120.
    **_rows(_GPT3, {
        "gpt3-125m": {"layers": 12, "hidden": 768, "heads": 12},
        "gpt3-350m": {"layers": 24, "hidden": 1024, "heads": 16},
        "gpt3-760m": {"layers": 24, "hidden": 1536, "heads": 16},
        "gpt3-1.3b": {"layers": 24, "hidden": 2048, "heads": 16},
        "gpt3-2.7b": {"layers": 32, "hidden": 2560, "heads": 32},
        "gpt3-6.7b": {"layers": 32, "hidden": 4096, "heads": 32},
        "gpt3-13b": {"layers": 40, "hidden": 5120, "heads": 40},
        "gpt3-175b": {"layers": 96, "hidden": 12288, "heads": 96},
    }),
    # SMNG-P2 paper's three sizes (authors' repository LRZ-BADW/LLMsOnSMNG-P2; GPT-2 vocabulary).
    **_rows(_GPT3, {
        "smng-p2-3.6b": {"layers": 30, "hidden": 3072, "heads": 32},
        "smng-p2-20b": {"layers": 44, "hidden": 6144, "heads": 64},
        "smng-p2-175b": {"layers": 96, "hidden": 12288, "heads": 96},
    }),
    # Narayanan et al., SC21, Table 1.
    **_rows(_SC21, {
        "sc21-1.7b": {"layers": 24, "hidden": 2304, "heads": 24},
        "sc21-3.6b": {"layers": 30, "hidden": 3072, "heads": 32},
        "sc21-7.5b": {"layers": 36, "hidden": 4096, "heads": 32},
        "sc21-18.4b": {"layers": 40, "hidden": 6144, "heads": 48},
        "sc21-39.1b": {"layers": 48, "hidden": 8192, "heads": 64},
        "sc21-76.1b": {"layers": 60, "hidden": 10240, "heads": 80},
        "sc21-145.6b": {"layers": 80, "hidden": 12288, "heads": 96},
        "sc21-310.1b": {"layers": 96, "hidden": 16384, "heads": 128},
        "sc21-529.6b": {"layers": 105, "hidden": 20480, "heads": 128},
        "sc21-1t": {"layers": 128, "hidden": 25600, "heads": 160},
        # The 1T model under its common name.
        "gpt-1t": {"layers": 128, "hidden": 25600, "heads": 160},
    }),
    # Llama 2 (Touvron et al. 2023, Table 1 and the released configs).
    **_rows(_LLAMA2, {
        "llama2-7b": {"layers": 32, "hidden": 4096, "heads": 32, "ffn": 11008},
        "llama2-13b": {"layers": 40, "hidden": 5120, "heads": 40, "ffn": 13824},
        "llama2-70b": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn": 28672},
    }),
    # Qwen3 (Qwen team, "Qwen3 Technical Report", arXiv 2505.09388, Tables 1-2, and the checkpoints'
    # config.json on Hugging Face, Qwen/Qwen3-*): head_dim 128 apart from hidden / heads, RMSNorm on
    # each query and key head, no biases. Dense: tied embeddings below 4B (not listed here). MoE: every
    # layer routed (decoder_sparse_step 1, mlp_only_layers []), no shared expert; intermediate_size,
    # the dense FFN width no layer uses, kept as ffn.
    **_rows(_QWEN3, {
        "qwen3-8b": {"layers": 36, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn": 12288},
        "qwen3-14b": {"layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 8, "ffn": 17408},
        "qwen3-32b": {"layers": 64, "hidden": 5120, "heads": 64, "kv_heads": 8, "ffn": 25600},
        "qwen3-30b-a3b": {"layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4, "ffn": 6144,
                          "experts": 128, "topk": 8, "expert_ffn": 768},
        "qwen3-235b-a22b": {"layers": 94, "hidden": 4096, "heads": 64, "kv_heads": 4, "ffn": 12288,
                            "experts": 128, "topk": 8, "expert_ffn": 1536},
    }),
    # GPT-OSS (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025, Table 1, and openai/gpt-oss-*'s
    # config.json): 128-token sliding window on every other layer (layer_types start with
    # sliding_attention), a learned sink logit per head, biases on QKV, the projection, the router
    # and the experts (attention_bias true; the experts' gate_up_proj_bias, down_proj_bias).
    # Its clamped SwiGLU (swiglu_limit 7) is priced as SwiGLU.
    **_rows(_GPT_OSS, {
        "gpt-oss-120b": {"layers": 36, "experts": 128},
        "gpt-oss-20b": {"layers": 24, "experts": 32},
    }),
    # DeepSeek-V3 (DeepSeek-AI, arXiv 2412.19437, section 4.2, and deepseek-ai/DeepSeek-V3's
    # config.json): latent attention, 3 dense layers of 18432 then 58 of 256 routed experts (top 8)
    # and one shared expert of 2048. Its multi-token-prediction module (num_nextn_predict_layers 1,
    # 14B more parameters) is out of scope. Node-limited routing (section 2.1.2): the 256 experts in
    # 8 groups (n_group), each token's 8 from the best 4 groups (topk_group), the groups laid on the
    # 8 nodes of its EP 64: routing_nodes 4.
    "deepseek-v3": {**_MODERN, "vocab": 129280, "layers": 61, "hidden": 7168, "heads": 128, "ffn": 18432,
                    "attention_type": "mla", "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_dim": 128,
                    "qk_rope_dim": 64, "v_head_dim": 128, "experts": 256, "topk": 8, "expert_ffn": 2048,
                    "shared_expert_ffn": 2048, "dense_layers": 3, "routing_nodes": 4},
    # Mixtral 8x7B (Jiang et al. 2024, arXiv 2401.04088, Table 1, and mistralai/Mixtral-8x7B-v0.1's
    # config.json): every layer 8 experts of 14336, top 2; no sliding window (sliding_window null).
    "mixtral-8x7b": {**_MODERN, "vocab": 32000, "layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
                     "ffn": 14336, "experts": 8, "topk": 2, "expert_ffn": 14336},
}
