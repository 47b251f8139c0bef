"""Model presets. Sources are named per family; every row is a published configuration."""

_GPT3 = {"seq": 2048, "vocab": 50257}
_SC21 = {"seq": 2048, "vocab": 51200}
_LLAMA2 = {"seq": 4096, "vocab": 32000, "gated_mlp": True, "tied_embeddings": False, "bias": False,
           "norm": "rmsnorm", "learned_positions": False, "dropout": False}


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
}
