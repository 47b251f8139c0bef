"""--model path/config.json: Hugging Face configs mapped to perfsim's model keys (perfsim.spec.hf_config).

The configs below hold the architecture fields of the released checkpoints' config.json (as
published on Hugging Face; shared/reference/published.md section 7 for the three calibration
models), with the metadata fields a real file carries; each must load as the matching preset.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from perfsim.errors import PerfsimError
from perfsim.spec.model import load_model

META = {"bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02, "rms_norm_eps": 1e-6, "use_cache": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "attention_dropout": 0.0,
        "tie_word_embeddings": False, "hidden_act": "silu", "rope_theta": 1000000.0, "rope_scaling": None}

QWEN3_30B_A3B = {**META, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                 "vocab_size": 151936, "max_position_embeddings": 40960, "attention_bias": False,
                 "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48,
                 "output_router_logits": False, "router_aux_loss_coef": 0.001}
QWEN3_235B_A22B = {**QWEN3_30B_A3B, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
                   "num_hidden_layers": 94, "num_attention_heads": 64, "max_window_layers": 94}
GPT_OSS_120B = {**META, "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
                "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
                "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4,
                "experts_per_token": 4, "vocab_size": 201088, "sliding_window": 128,
                "layer_types": ["sliding_attention", "full_attention"] * 18, "attention_bias": True,
                "max_position_embeddings": 131072, "initial_context_length": 4096, "swiglu_limit": 7.0,
                "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0},
                "quantization_config": {"quant_method": "mxfp4"}, "pad_token_id": 199999,
                "output_router_logits": False, "router_aux_loss_coef": 0.9}
DEEPSEEK_V3 = {**META, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256, "n_shared_experts": 1,
               "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "q_lora_rank": 1536,
               "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "vocab_size": 129280, "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
               "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
               "topk_method": "noaux_tc", "norm_topk_prob": True, "aux_loss_alpha": 0.001, "seq_aux": True,
               "ep_size": 1, "pretraining_tp": 1, "attention_bias": False}
MIXTRAL_8X7B = {**META, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                "max_position_embeddings": 32768, "sliding_window": None, "router_jitter_noise": 0.0,
                "output_router_logits": False, "router_aux_loss_coef": 0.02}
LLAMA2_7B = {**META, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096, "pretraining_tp": 1,
             "attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0}
QWEN3_8B = {**META, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "max_window_layers": 36}

CASES = {"qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-235b-a22b": QWEN3_235B_A22B, "gpt-oss-120b": GPT_OSS_120B,
         "deepseek-v3": DEEPSEEK_V3, "mixtral-8x7b": MIXTRAL_8X7B, "llama2-7b": LLAMA2_7B, "qwen3-8b": QWEN3_8B}


def _write(tmp_path, config: dict, name: str = "model") -> str:
    folder = tmp_path / name
    folder.mkdir(exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _shape(model) -> dict:
    return {k: v for k, v in model.as_dict().items() if k not in ("name", "seq")}


@pytest.mark.parametrize("preset", list(CASES))
def test_config_loads_as_the_preset(tmp_path, preset):
    model = load_model(_write(tmp_path, CASES[preset], preset))
    assert model.name == preset  # the checkpoint's folder
    expected = load_model(preset)
    assert _shape(model) == _shape(expected)
    assert model.seq == 4096  # the default training sequence, not max_position_embeddings


def test_seq_and_other_keys_are_overridden_after_the_path(tmp_path):
    path = _write(tmp_path, QWEN3_30B_A3B)
    model = load_model(f"{path},seq=8192,capacity_factor=1.25")
    assert (model.seq, model.capacity_factor, model.experts) == (8192, 1.25, 128)


def test_gpt_oss_windows_every_other_layer_from_the_first(tmp_path):
    model = load_model(_write(tmp_path, GPT_OSS_120B))
    assert (model.window, model.window_every, model.attention_sinks, model.bias) == (128, 2, True, True)


@pytest.mark.parametrize("change, field", [
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"mlp_only_layers": [5]}, "mlp_only_layers"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"some_new_field": 3}, "some_new_field"),
    ({"model_type": "phi3"}, "model_type"),
    ({"num_experts": 12.5}, "num_experts"),
])
def test_unpriceable_fields_are_one_line_errors_naming_them(tmp_path, change, field):
    path = _write(tmp_path, {**QWEN3_30B_A3B, **change})
    with pytest.raises(PerfsimError, match=field) as info:
        load_model(path)
    assert "\n" not in str(info.value)


def test_other_unpriceable_patterns(tmp_path):
    windows = {**GPT_OSS_120B, "layer_types": ["sliding_attention"] * 3 + ["full_attention"] * 33}
    with pytest.raises(PerfsimError, match="layer_types"):
        load_model(_write(tmp_path, windows, "w"))
    with pytest.raises(PerfsimError, match="moe_layer_freq"):
        load_model(_write(tmp_path, {**DEEPSEEK_V3, "moe_layer_freq": 2}, "d"))
    with pytest.raises(PerfsimError, match="attention_bias"):
        load_model(_write(tmp_path, {**LLAMA2_7B, "attention_bias": True}, "l"))
    with pytest.raises(PerfsimError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        load_model(str(tmp_path / "bad.json"))


def test_cli_takes_a_config_and_bad_fields_exit_2(tmp_path):
    path = _write(tmp_path, {**MIXTRAL_8X7B, "num_local_experts": "eight"})
    run = subprocess.run([sys.executable, "-m", "perfsim.cli", "predict", "--model", path, "--system", "dgx-h100",
                          "--devices", "8", "--tp", "8", "--mbs", "1", "--gbs", "8"], capture_output=True, text=True)
    assert run.returncode == 2 and "num_local_experts" in run.stderr and len(run.stderr.strip().splitlines()) == 1
