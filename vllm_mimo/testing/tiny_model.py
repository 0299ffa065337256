"""Write small, local, random-weight model folders that vLLM loads with no network.

    python -m vllm_mimo.testing.tiny_model OUT_DIR [--layout mimo|mimo-flash|gemma3|llama]

Each folder holds `config.json`, `model.safetensors` (random weights from a fixed seed)
and a byte-level BPE tokenizer trained here on the Python standard library's sources.

Layouts:
  mimo    MiMo-V2.5-Pro in miniature: `hybrid_layer_pattern` of 1 full : 6 SWA, window 128,
          SWA attention-sink bias, 3 MTP layers (`model.mtp.layers.{0,1,2}.*`), dense MLP,
          qk head dim == v head dim == 64 (a CPU attention head size).
  mimo-flash  the same with twice as many KV heads in the SWA layers as in the full ones, as
          MiMo-V2-Flash has (8 against 4): the pages differ, so vLLM gives the full layers'
          KV cache group blocks of twice as many tokens as the SWA groups'.
  gemma3  Gemma 3 text: 5 local (sliding, window 128) : 1 global layer.
  llama   plain Llama, no sliding window: the plugin must leave it alone.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

LAYOUTS = ("mimo", "mimo-flash", "gemma3", "llama")
SEED = 1234
WINDOW = 128

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML, as MiMo's own tokenizer uses. Content may be a string or a list of text parts.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class ModelSize:
    """Dimensions shared by every layout (MiMo's SWA and full layers use the same heads here)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 512
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 8192


def mimo_hybrid_pattern(num_layers: int) -> list[int]:
    """1 full : 6 SWA, full first in each period of 7 (1 = SWA), as in MiMo-V2.5-Pro."""
    return [0 if i % 7 == 0 else 1 for i in range(num_layers)]


def gemma3_layer_types(num_layers: int) -> list[str]:
    """5 local : 1 global, global last in each period of 6, as in Gemma 3."""
    return [
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
        for i in range(num_layers)
    ]


def make_config(
    layout: str,
    size: ModelSize = ModelSize(),
    num_layers: int | None = None,
    num_mtp_layers: int = 3,
    token_ids: dict[str, int] | None = None,
) -> dict:
    """The `config.json` contents for a layout. `token_ids` maps special tokens to ids."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    ids = token_ids or {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    common = {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "intermediate_size": size.intermediate_size,
        "num_attention_heads": size.num_attention_heads,
        "num_key_value_heads": size.num_key_value_heads,
        "head_dim": size.head_dim,
        "max_position_embeddings": size.max_position_embeddings,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "torch_dtype": "bfloat16",
    }
    if layout in ("mimo", "mimo-flash"):
        return common | _mimo_fields(layout, size, num_layers or 7, num_mtp_layers)
    if layout == "gemma3":
        return common | _gemma3_fields(size, num_layers or 6)
    return common | {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": num_layers or 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10_000.0,
        "tie_word_embeddings": False,
    }


def _mimo_fields(layout: str, size: ModelSize, n: int, num_mtp_layers: int) -> dict:
    """`make_config`'s fields of a MiMo-V2 layout ("mimo", or "mimo-flash": SWA layers with
    twice the KV heads) of `n` layers."""
    swa_kv_heads = size.num_key_value_heads * (2 if layout == "mimo-flash" else 1)
    pattern = mimo_hybrid_pattern(n)
    # Hub field names, which vLLM's mimo_v2.py reads; the transformers-native
    # MiMoV2FlashConfig names (layer_types, sliding_window) are set to agree with them,
    # and attention_value_scale is explicit because the native default is 0.707.
    return {
        "architectures": ["MiMoV2FlashForCausalLM"],
        "model_type": "mimo_v2_flash",
        "num_hidden_layers": n,
        "hybrid_layer_pattern": pattern,
        "layer_types": [
            "sliding_attention" if p == 1 else "full_attention" for p in pattern
        ],
        "sliding_window_size": WINDOW,
        "sliding_window": WINDOW,
        "swa_num_attention_heads": size.num_attention_heads,
        "swa_num_key_value_heads": swa_kv_heads,
        "swa_head_dim": size.head_dim,
        "swa_v_head_dim": size.head_dim,
        "v_head_dim": size.head_dim,
        "add_swa_attention_sink_bias": True,
        "add_full_attention_sink_bias": False,
        "attention_value_scale": None,
        "rope_theta": 1_000_000.0,
        "swa_rope_theta": 10_000.0,
        "partial_rotary_factor": 0.5,
        "attention_bias": False,
        "hidden_act": "silu",
        "layernorm_epsilon": 1e-5,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": num_mtp_layers,
    }


def _gemma3_fields(size: ModelSize, n: int) -> dict:
    """`make_config`'s fields of the Gemma 3 layout of `n` layers."""
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": n,
        "layer_types": gemma3_layer_types(n),
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": size.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
        "tie_word_embeddings": True,
    }


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes, as each vLLM model class loads them."""
    h = config["hidden_size"]
    inter = config["intermediate_size"]
    hd = config["head_dim"]
    q = config["num_attention_heads"] * hd
    kv = config["num_key_value_heads"] * hd
    # MiMo's SWA layers (and its MTP layers, which are SWA) may have their own KV head count.
    swa_kv = config.get("swa_num_key_value_heads", config["num_key_value_heads"]) * hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)

    def attention_and_mlp(prefix: str, kv: int) -> None:
        shapes[f"{prefix}.self_attn.q_proj.weight"] = (q, h)
        shapes[f"{prefix}.self_attn.k_proj.weight"] = (kv, h)
        shapes[f"{prefix}.self_attn.v_proj.weight"] = (kv, h)
        shapes[f"{prefix}.self_attn.o_proj.weight"] = (h, q)
        shapes[f"{prefix}.mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{prefix}.mlp.up_proj.weight"] = (inter, h)
        shapes[f"{prefix}.mlp.down_proj.weight"] = (h, inter)
        shapes[f"{prefix}.input_layernorm.weight"] = (h,)

    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        swa = config.get("hybrid_layer_pattern", [0] * (i + 1))[i] == 1
        attention_and_mlp(prefix, swa_kv if swa else kv)
        shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
        if config["model_type"] == "gemma3_text":
            shapes[f"{prefix}.pre_feedforward_layernorm.weight"] = (h,)
            shapes[f"{prefix}.post_feedforward_layernorm.weight"] = (h,)
            shapes[f"{prefix}.self_attn.q_norm.weight"] = (hd,)
            shapes[f"{prefix}.self_attn.k_norm.weight"] = (hd,)
        if swa and config.get("add_swa_attention_sink_bias"):
            shapes[f"{prefix}.self_attn.attention_sink_bias"] = (
                config["num_attention_heads"],
            )
    for i in range(config.get("num_nextn_predict_layers", 0)):
        # MiMoV2MTPLayer: eh_proj(cat(enorm(emb), hnorm(prev))) -> SWA block -> final norm.
        prefix = f"model.mtp.layers.{i}"
        attention_and_mlp(prefix, swa_kv)
        shapes[f"{prefix}.enorm.weight"] = (h,)
        shapes[f"{prefix}.hnorm.weight"] = (h,)
        shapes[f"{prefix}.eh_proj.weight"] = (h, 2 * h)
        shapes[f"{prefix}.pre_mlp_layernorm.weight"] = (h,)
        shapes[f"{prefix}.final_layernorm.weight"] = (h,)
        if config.get("add_swa_attention_sink_bias"):
            shapes[f"{prefix}.self_attn.attention_sink_bias"] = (
                config["num_attention_heads"],
            )
    return shapes


def random_weights(config: dict, seed: int = SEED) -> dict:
    """Random bf16 weights: norms at their identity, matrices scaled by 1/sqrt(fan_in)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    # Gemma's RMSNorm multiplies by (1 + w), so its identity is 0.
    norm_identity = 0.0 if config["model_type"] == "gemma3_text" else 1.0
    tensors = {}
    for name, shape in parameter_shapes(config).items():
        if len(shape) == 1 and name.endswith("norm.weight"):
            t = torch.full(shape, norm_identity)
        elif name.endswith("attention_sink_bias"):
            t = torch.randn(shape, generator=gen)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) / shape[-1] ** 0.5
        tensors[name] = t.to(torch.bfloat16).contiguous()
    return tensors


def stdlib_text_files() -> list[Path]:
    """The interpreter's own standard-library sources, in a fixed order (no tests, no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in sorted(root.rglob("*.py"))
        if not {"site-packages", "test", "tests", "idlelib", "lib2to3"} & set(
            p.relative_to(root).parts
        )
    ]
    if not files:
        raise RuntimeError(f"no Python sources found under {root} to train a tokenizer on")
    return files


def train_tokenizer(vocab_size: int, files: list[Path], max_bytes: int = 4_000_000):
    """A byte-level BPE trained on `files` (up to `max_bytes` of text), with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        used = 0
        for path in files:
            text = path.read_text(encoding="utf-8", errors="replace")
            used += len(text)
            yield text
            if used >= max_bytes:
                return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    return tok


def write_tokenizer(out: Path, tok) -> dict[str, int]:
    """Save `tok` as a transformers fast tokenizer with the ChatML template; return special ids."""
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "model_max_length": 8192,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
        )
    )
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def write_model_folder(out: Path, config: dict, tensors: dict, tok) -> None:
    """Write config, weights, tokenizer and generation config into `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, tok)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": config["eos_token_id"],
                "pad_token_id": config["pad_token_id"],
            }
        )
        + "\n"
    )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


@functools.cache
def stdlib_tokenizer(vocab_size: int):
    """`train_tokenizer` on the standard library's sources, trained once per process (training
    is deterministic; the test suite makes four layouts' models with the same vocabulary)."""
    return train_tokenizer(vocab_size, stdlib_text_files())


def make_tiny_model(out: str | Path, layout: str = "mimo", seed: int = SEED) -> Path:
    """Create a complete random-weight model folder for `layout` at `out`; return its path."""
    out = Path(out)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    size = ModelSize()
    tok = stdlib_tokenizer(size.vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    config = make_config(layout, size, token_ids=ids)
    write_model_folder(out, config, random_weights(config, seed), tok)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_mimo.testing.tiny_model",
        description="Write a tiny random-weight model folder that vLLM loads offline.",
    )
    parser.add_argument("out_dir", help="folder to write (created if missing; files are overwritten)")
    parser.add_argument(
        "--layout",
        default="mimo",
        choices=LAYOUTS,
        help="mimo: MiMo-V2.5-Pro in miniature (1 full : 6 SWA, W=128, sinks, 3 MTP layers); "
        "mimo-flash: the same with 2x the KV heads in SWA layers, as MiMo-V2-Flash (full and SWA "
        "KV cache groups get different block sizes); gemma3: 5 local : 1 global, W=128; llama: no sliding window (default: mimo)",
    )
    parser.add_argument("--seed", type=int, default=SEED, help=f"weight seed (default: {SEED})")
    args = parser.parse_args(argv)
    out = make_tiny_model(args.out_dir, args.layout, args.seed)
    print(f"wrote {args.layout} model to {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
