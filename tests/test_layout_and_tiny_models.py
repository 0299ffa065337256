"""Hybrid-layout detection from configs, and the tiny model folders."""

from __future__ import annotations

import json
from types import SimpleNamespace

from safetensors import safe_open

from vllm_mimo.layout import layout_from_hf_config
from vllm_mimo.testing.tiny_model import make_config, parameter_shapes


def _cfg(**fields):
    return SimpleNamespace(**fields)


def test_mimo_pattern():
    layout = layout_from_hf_config(
        _cfg(model_type="mimo_v2", num_hidden_layers=14, hybrid_layer_pattern=[0] + [1] * 6 + [0] + [1] * 6,
             sliding_window_size=128, num_nextn_predict_layers=3)
    )
    assert layout.full_layers == (0, 7) and len(layout.swa_layers) == 12
    assert layout.window == 128 and layout.mtp_layers == 3


def test_gpt_oss_slides_on_even_layers_whatever_layer_types_says():
    layout = layout_from_hf_config(
        _cfg(model_type="gpt_oss", num_hidden_layers=4, sliding_window=128, layer_types=["full_attention"] * 4)
    )
    assert layout.swa_layers == (0, 2) and layout.full_layers == (1, 3)


def test_layer_types():
    types = ["sliding_attention"] * 5 + ["full_attention"]
    layout = layout_from_hf_config(_cfg(model_type="gemma3_text", num_hidden_layers=6, sliding_window=1024, layer_types=types))
    assert layout.full_layers == (5,) and layout.window == 1024


def test_not_hybrid():
    assert layout_from_hf_config(_cfg(model_type="llama", num_hidden_layers=4)) is None
    # every layer sliding (Mistral-style) is not a hybrid
    assert layout_from_hf_config(
        _cfg(model_type="mistral", num_hidden_layers=2, sliding_window=4096, layer_types=["sliding_attention"] * 2)
    ) is None
    # a pattern without a window is not a hybrid
    assert layout_from_hf_config(
        _cfg(model_type="mimo_v2", num_hidden_layers=2, hybrid_layer_pattern=[0, 1], sliding_window_size=-1)
    ) is None


def test_text_config_of_a_multimodal_config_is_used():
    text = _cfg(
        model_type="gemma3_text", num_hidden_layers=2, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
    )
    outer = SimpleNamespace(get_text_config=lambda: text)
    assert layout_from_hf_config(outer).full_layers == (1,)


def test_tiny_mimo_folder(tiny_models):
    folder = tiny_models["mimo"]
    config = json.loads((folder / "config.json").read_text())
    assert config["hybrid_layer_pattern"] == [0, 1, 1, 1, 1, 1, 1]
    assert config["layer_types"] == ["full_attention"] + ["sliding_attention"] * 6
    assert config["sliding_window_size"] == config["sliding_window"] == 128
    assert config["head_dim"] == config["v_head_dim"] == config["swa_head_dim"] == config["swa_v_head_dim"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {n.split(".")[3] for n in names if n.startswith("model.mtp.layers.")} == {"0", "1", "2"}
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "torch.bfloat16"
    assert names == set(parameter_shapes(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (folder / name).exists()


def test_tiny_mimo_flash_folder_has_twice_the_kv_heads_in_swa_layers(tiny_models):
    folder = tiny_models["mimo-flash"]
    config = json.loads((folder / "config.json").read_text())
    assert config["swa_num_key_value_heads"] == 2 * config["num_key_value_heads"]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(parameter_shapes(config))
        full, swa, mtp = (f.get_slice(f"model.{layer}.self_attn.k_proj.weight").get_shape()
                          for layer in ("layers.0", "layers.1", "mtp.layers.0"))
    assert swa == mtp == [2 * full[0], full[1]]


def test_tiny_model_is_reproducible(tiny_models, tmp_path):
    from vllm_mimo.testing.tiny_model import make_tiny_model

    again = make_tiny_model(tmp_path / "again", "gemma3")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_models["gemma3"] / name).read_bytes()


def test_chat_template_renders_chatml(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_models["mimo"]))
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "U"}]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_layouts_declare_what_make_config_writes():
    assert layout_from_hf_config(SimpleNamespace(**make_config("gemma3"))).full_layers == (5,)
    assert layout_from_hf_config(SimpleNamespace(**make_config("llama"))) is None
