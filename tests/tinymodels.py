"""Tiny real checkpoints written on the fly for end-to-end tests (HF Llama directory + byte-level tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<mask>"]


def write_byte_tokenizer(path: Path) -> int:
    """Byte-level BPE without merges: every UTF-8 byte is a token, plus ChatML specials. Returns the vocab size."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {t: i for i, t in enumerate(SPECIALS + sorted(alphabet))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    tk.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "add_bos_token": False,
                "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            }
        )
    )
    return len(vocab)


def write_tiny_llama(
    path: Path, *, hidden=64, layers=4, heads=4, kv_heads=2, inter=128, seed=0, std=0.08, max_positions=1024
) -> Path:
    """A random-weight Llama checkpoint (HF names, [out, in] matrices) with a byte-level tokenizer."""
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    vocab = write_byte_tokenizer(path)
    hd = hidden // heads
    rng = np.random.default_rng(seed)

    def m(*shape):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    t = {"model.embed_tokens.weight": m(vocab, hidden), "model.norm.weight": np.ones(hidden, np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(hidden, np.float32)
        t[p + "self_attn.q_proj.weight"] = m(heads * hd, hidden)
        t[p + "self_attn.k_proj.weight"] = m(kv_heads * hd, hidden)
        t[p + "self_attn.v_proj.weight"] = m(kv_heads * hd, hidden)
        t[p + "self_attn.o_proj.weight"] = m(hidden, heads * hd)
        t[p + "mlp.gate_proj.weight"] = m(inter, hidden)
        t[p + "mlp.up_proj.weight"] = m(inter, hidden)
        t[p + "mlp.down_proj.weight"] = m(hidden, inter)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": vocab,
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": kv_heads,
                "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0,
                "tie_word_embeddings": True,
                "max_position_embeddings": max_positions,
                "eos_token_id": 2,
            }
        )
    )
    return path
