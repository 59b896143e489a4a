"""Target-model parity with Hugging Face transformers (the test-only oracle, `oracle` extra).

Tiny random Llama and Qwen3 checkpoints are built with transformers, saved with `save_pretrained` (f32
safetensors) next to a small `tokenizer.json`, and loaded with our `load_target(dir)`. Then:
  * logits (max abs diff <= 1e-4) and captured hidden states (layer id i = HF `hidden_states[i+1]`, the last one
    final-normed, taps concatenated in the order asked for) match HF;
  * 32-token greedy continuations from our SpecRunner (no drafter, two sequences batched) equal HF `generate`;
  * a sharded checkpoint with `model.safetensors.index.json` loads to the same model.
Also (our model alone, on the loaded weights): KV-cache decoding equals a full-sequence forward, a T-token verify
equals T single-token decodes, and stale cache rows left by a rejected verify are invisible.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from dflash_jax.checkpoints.loader import load_target  # noqa: E402
from dflash_jax.models.layers import Pages, read_rows  # noqa: E402
from dflash_jax.models.target import contiguous_kv_cache, target_forward  # noqa: E402
from dflash_jax.spec_decode.runner import SpecRunner  # noqa: E402
from dflash_jax.types import SamplingParams  # noqa: E402

LOGIT_TOL = 1e-4

# name -> (HF config class name, kwargs). Several shapes, GQA ratios (1, 2, 4, 6 = MQA), tied/untied,
# head_dim != hidden/heads, rope_scaling llama3 and linear, different rope thetas and eps.
CONFIGS: dict[str, tuple[str, dict]] = {
    "llama-gqa2-untied": (
        "LlamaConfig",
        dict(
            vocab_size=160,
            hidden_size=64,
            intermediate_size=112,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
        ),
    ),
    "llama-mqa-tied-llama3rope": (
        "LlamaConfig",
        # head_dim 8, theta 1e4: wavelengths 6.3 (kept), 63 (in the smoothed band [40, 160]), 628 and 6283 (scaled)
        dict(
            vocab_size=128,
            hidden_size=48,
            intermediate_size=80,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=1,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=True,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 160,
            },
        ),
    ),
    "llama-headdim-linearrope": (
        "LlamaConfig",
        dict(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            rope_scaling={"rope_type": "linear", "factor": 2.0},
        ),
    ),
    "qwen3-gqa4-untied": (
        "Qwen3Config",
        dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=3,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=False,
        ),
    ),
    "qwen3-tied-wide-heads": (
        "Qwen3Config",
        dict(
            vocab_size=112,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        ),
    ),
}


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer over "w0".."w{V-1}" (the loader needs a tokenizer.json next to the weights)."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "w1", "eos_token": "w2"}))


def build_hf(cls_name: str, kwargs: dict, seed: int):
    """A random HF model with norms 1 + N(0, 0.1^2) (so a swapped or skipped norm shows) and weights large enough
    that logits are well spread and greedy continuations do not collapse into repeating the last token (tied
    models need a smaller embedding and stronger layers for that)."""
    cfg = getattr(transformers, cls_name)(bos_token_id=None, eos_token_id=None, pad_token_id=None, **kwargs)
    model_cls = getattr(
        transformers, cls_name.removesuffix("Config") + "ForCausalLM"
    )  # LlamaConfig -> LlamaForCausalLM
    emb_std, mat_std = (0.5, 0.35) if kwargs["tie_word_embeddings"] else (1.0, 0.15)
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(emb_std * torch.randn_like(p))
            else:
                p.copy_(mat_std * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class Case:
    def __init__(self, name, hf, path, loaded):
        self.name, self.hf, self.path, self.lt = name, hf, path, loaded
        self.cfg = loaded.cfg


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def case(request, tmp_path_factory) -> Case:
    cls_name, kw = CONFIGS[request.param]
    hf = build_hf(cls_name, kw, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, kw["vocab_size"])
    assert (path / "model.safetensors").exists()
    return Case(request.param, hf, path, load_target(str(path)))


def our_forward(model, tokens: np.ndarray, capture=(), kv_len=None):
    """Full-sequence forward from an empty cache: tokens [B,T] at positions 0..T-1."""
    b, t = tokens.shape
    kv_len = kv_len or t
    graphdef, state = nnx.split(model)
    cache, pages = contiguous_kv_cache(model.cfg, b, kv_len, model.dtype, page_size=8)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = target_forward(
        graphdef,
        state,
        jnp.asarray(tokens, jnp.int32),
        pos,
        cache,
        pages,
        capture=tuple(capture),
        kv_len=kv_len,
    )
    return np.asarray(out.logits), (None if out.hidden is None else np.asarray(out.hidden))


def hf_forward(hf, tokens: np.ndarray):
    with torch.no_grad():
        out = hf(torch.as_tensor(tokens, dtype=torch.long), output_hidden_states=True)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


# ------------------------------------------------------------------------------------------------ parity with HF
def test_config_read_from_hf_dir(case):
    c, hfc = case.cfg, case.hf.config
    assert c.arch == ("qwen3" if "qwen3" in case.name else "llama")
    assert (c.vocab_size, c.hidden_size, c.num_layers) == (hfc.vocab_size, hfc.hidden_size, hfc.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (hfc.num_attention_heads, hfc.num_key_value_heads, hfc.head_dim)
    assert c.tie_word_embeddings == bool(hfc.tie_word_embeddings)
    kw = CONFIGS[case.name][1]
    if "rope_scaling" in kw:
        assert c.rope_scaling is not None and c.rope_scaling.rope_type == kw["rope_scaling"]["rope_type"]
        assert c.rope_scaling.factor == kw["rope_scaling"]["factor"]
    else:
        assert c.rope_scaling is None
    assert c.rope_theta == kw["rope_theta"]


def test_logits_and_hidden_states_match_hf(case):
    rng = np.random.default_rng(0)
    L = case.cfg.num_layers
    tokens = rng.integers(0, case.cfg.vocab_size, size=(2, 19))
    capture = (L - 2, *range(L - 2), L - 1)  # not sorted: taps come back concatenated in the order asked for
    ours, hidden = our_forward(case.lt.model, tokens, capture=capture, kv_len=24)
    ref, ref_hidden = hf_forward(case.hf, tokens)
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() <= LOGIT_TOL, f"max |logits - HF| = {np.abs(ours - ref).max():.2e}"
    # the logits must be far from uniform, or the tolerance would say little
    assert ref.std() > 0.5
    h = case.cfg.hidden_size
    assert hidden.shape == (2, 19, L * h)
    taps = {i: hidden[..., j * h : (j + 1) * h] for j, i in enumerate(capture)}
    # layer id i = HF hidden_states[i + 1]: the output of decoder layer i; HF's last entry (layer id L-1) is that
    # layer's output after the final norm, and so is ours (a drafter tapping the last layer sees what HF gives it)
    for i in range(L):
        np.testing.assert_allclose(taps[i], ref_hidden[i + 1], atol=1e-4, rtol=1e-4, err_msg=f"layer id {i}")


BF16_U = 2.0**-8  # bfloat16 unit roundoff (8 significant bits, round to nearest)


def test_bf16_logits_within_bf16_rounding_of_f32(case):
    """The same checkpoint loaded with dtype bfloat16: weights, hidden states and KV cache are bfloat16, the logits
    float32, and they stay within bf16 rounding of the float32 model's.

    Tolerance, from bf16's relative precision u = 2^-8: bf16 perturbs every weight and every matmul input by a
    relative <= u. How far a relative-u perturbation moves this model's logits is measured on the same tokens:
    S = max |logits(W * (1 + u * s)) - logits(W)| in f32, s = random signs per weight (attention's softmax
    amplifies score errors, so S is a property of each config, not a constant). Rounding the weights is a
    perturbation of at most that size and rounding the activations one more of the same size, 2S; random signs
    do not realise the worst case of either, another factor 2: max |logits_bf16 - logits_f32| <= 4S. The naive
    bound without the measured amplification, 2u (4L + 2) max |logits| (two roundings per matmul stage, 4 stages
    per layer, 2 more for embedding and head), is exceeded by transformers' own bf16 run on the tied llama3-RoPE
    config, whose large attention scores amplify rounding."""
    lt16 = load_target(str(case.path), jnp.bfloat16)
    assert lt16.model.dtype == jnp.bfloat16
    state = nnx.state(lt16.model, nnx.Param)
    assert {str(x.dtype) for x in jax.tree.leaves(state)} == {"bfloat16"}
    rng = np.random.default_rng(4)
    L = case.cfg.num_layers
    tokens = rng.integers(0, case.cfg.vocab_size, size=(2, 19))
    ref, _ = our_forward(case.lt.model, tokens, kv_len=24)
    graphdef, st32 = nnx.split(case.lt.model)
    signs = np.random.default_rng(5)
    perturbed = jax.tree.map(
        lambda x: x * (1 + BF16_U * jnp.asarray(signs.choice([-1.0, 1.0], x.shape), x.dtype)), st32
    )
    sens = np.abs(our_forward(nnx.merge(graphdef, perturbed), tokens, kv_len=24)[0] - ref).max()
    b, t = tokens.shape
    cache, pages = contiguous_kv_cache(lt16.cfg, b, 24, lt16.model.dtype, page_size=8)
    graphdef, st = nnx.split(lt16.model)
    out = target_forward(
        graphdef,
        st,
        jnp.asarray(tokens, jnp.int32),
        jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
        cache,
        pages,
        capture=(L - 1,),
        kv_len=24,
    )
    assert out.logits.dtype == jnp.float32 and out.hidden.dtype == jnp.bfloat16
    assert {str(x.dtype) for x in jax.tree.leaves(out.cache)} == {"bfloat16"}
    err = np.abs(np.asarray(out.logits) - ref).max()
    assert err <= 4 * sens, f"max |bf16 - f32 logits| = {err:.3g} > 4 S = {4 * sens:.3g}"
    assert err > 0  # the bf16 model really computed in bf16


def test_greedy_32_tokens_match_hf_generate(case):
    """Our plain greedy decode (SpecRunner without a drafter, two different-length prompts batched) produces
    the same 32 tokens as HF `generate(do_sample=False)` run on each prompt alone."""
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, case.cfg.vocab_size, size=n).tolist() for n in (5, 13)]
    runner = SpecRunner(case.lt.model, None, max_slots=2, max_model_len=64)
    first = runner.add_many([(s, p, SamplingParams()) for s, p in enumerate(prompts)])
    got = {s: r.tokens[:] for s, r in first.items()}
    for _ in range(31):
        for s, r in runner.step([0, 1]).items():
            assert len(r.tokens) == 1
            got[s] += r.tokens
    for s, p in enumerate(prompts):
        with torch.no_grad():
            ids = torch.tensor([p])
            out = case.hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),  # explicit: HF would mask a prompt token equal to pad_token_id
                max_new_tokens=32,
                min_new_tokens=32,
                do_sample=False,
                pad_token_id=0,
            )
        ref = out[0, len(p) :].tolist()
        assert len(ref) == 32 and len(set(ref)) >= 4, f"degenerate reference continuation {ref}"
        assert got[s] == ref, f"prompt {s}: ours {got[s]} vs HF {ref}"


def test_sharded_checkpoint_with_index_loads_the_same(case, tmp_path):
    path = tmp_path / "sharded"
    case.hf.save_pretrained(str(path), safe_serialization=True, max_shard_size="20KB")
    write_tokenizer(path, case.cfg.vocab_size)
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) > 1 and (path / "model.safetensors.index.json").exists()
    lt = load_target(str(path))
    assert dataclasses.replace(lt.cfg, name=case.cfg.name) == case.cfg
    a = nnx.to_flat_state(nnx.state(lt.model, nnx.Param))
    b = dict(nnx.to_flat_state(nnx.state(case.lt.model, nnx.Param)))
    assert len(a) == len(b)
    for k, v in a:  # bit-identical to the single-file load (whose logits match HF above)
        np.testing.assert_array_equal(np.asarray(v[...]), np.asarray(b[k][...]), err_msg=str(k))


# ------------------------------------------------------------------------------------------------ cache semantics
@pytest.fixture(scope="module")
def cache_case(tmp_path_factory) -> Case:
    """One Qwen3 GQA checkpoint for the cache tests (logits there are compared to HF as well)."""
    name = "qwen3-gqa4-untied"
    cls_name, kw = CONFIGS[name]
    hf = build_hf(cls_name, kw, seed=7)
    path = tmp_path_factory.mktemp("cache")
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, kw["vocab_size"])
    return Case(name, hf, path, load_target(str(path)))


KV = 32  # one static kv bucket for every call below (so each shape compiles once)


class Stepper:
    """Drives `target_forward` on the pages of three sequences the way the runner does (the rows' page tables,
    per-row positions)."""

    def __init__(self, model, capture=(0, 1)):
        self.graphdef, self.state = nnx.split(model)
        self.cache, pages = contiguous_kv_cache(model.cfg, 3, KV, page_size=8)
        self.table = pages.table
        self.capture = capture

    def pages(self, slots) -> Pages:
        """The page tables of sequences `slots`, in that order."""
        return Pages(self.table[jnp.asarray(slots, jnp.int32)])

    def __call__(self, tokens, positions, slots):
        out = target_forward(
            self.graphdef,
            self.state,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(positions, jnp.int32),
            self.cache,
            self.pages(slots),
            capture=self.capture,
            kv_len=KV,
        )
        self.cache = out.cache
        return np.asarray(out.logits), np.asarray(out.hidden)

    def fork(self) -> Stepper:
        other = object.__new__(Stepper)
        other.graphdef, other.state, other.capture, other.table = self.graphdef, self.state, self.capture, self.table
        other.cache = jax.tree.map(jnp.copy, self.cache)
        return other


def test_kv_cache_decode_and_verify_equal_full_forward(cache_case):
    """Two sequences (lengths 7 and 11) in slots 2 and 0, prefilled together (padded); then
    (a) 5 single-token decodes, (b) one 5-token verify. Both equal a full-sequence forward of each sequence
    alone, and (a) == (b) in logits, captured hidden states and the cache rows they wrote."""
    model = cache_case.lt.model
    V = cache_case.cfg.vocab_size
    rng = np.random.default_rng(4)
    lens = (7, 11)
    slots = [2, 0]
    T = 5
    seqs = [rng.integers(0, V, size=n + T) for n in lens]
    pad = np.zeros((2, max(lens)), np.int64)
    for i, n in enumerate(lens):
        pad[i, :n] = seqs[i][:n]
    st = Stepper(model)
    pf_logits, _ = st(pad, np.broadcast_to(np.arange(max(lens)), (2, max(lens))), slots)

    a = st.fork()
    dec_logits, dec_hidden = [], []
    for j in range(T):
        toks = np.array([[seqs[i][lens[i] + j]] for i in range(2)])
        pos = np.array([[lens[i] + j] for i in range(2)])
        lg, hd = a(toks, pos, slots)
        dec_logits.append(lg[:, 0])
        dec_hidden.append(hd[:, 0])
    dec_logits, dec_hidden = np.stack(dec_logits, 1), np.stack(dec_hidden, 1)

    b = st.fork()
    toks = np.stack([seqs[i][lens[i] : lens[i] + T] for i in range(2)])
    pos = np.stack([np.arange(lens[i], lens[i] + T) for i in range(2)])
    ver_logits, ver_hidden = b(toks, pos, slots)

    np.testing.assert_allclose(ver_logits, dec_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ver_hidden, dec_hidden, atol=1e-5, rtol=1e-5)
    for (ka, va), (kb, vb) in zip(a.cache, b.cache, strict=True):
        for i, s in enumerate(slots):
            n, rows = lens[i] + T, st.pages([s])
            for x, y in ((ka, kb), (va, vb)):
                got, want = (np.asarray(read_rows(c, rows, KV))[0, :, :n] for c in (x, y))
                assert np.abs(want).max() > 0  # the rows were written
                np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)

    for i in range(2):
        full, full_hidden = our_forward(model, seqs[i][None], capture=(0, 1))
        n = lens[i]
        np.testing.assert_allclose(pf_logits[i, :n], full[0, :n], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(ver_logits[i], full[0, n : n + T], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(ver_hidden[i], full_hidden[0, n : n + T], atol=1e-5, rtol=1e-5)
        ref, _ = hf_forward(cache_case.hf, seqs[i][None])
        assert np.abs(ver_logits[i] - ref[0, n : n + T]).max() <= LOGIT_TOL


def test_stale_rows_of_a_rejected_verify_are_invisible(cache_case):
    """Rollback only moves lengths: after a verify of junk drafts at P..P+3 of which none is accepted, decoding
    on from P+1 (rows P+1..P+3 still hold the junk K/V) gives exactly the logits of a clean cache."""
    model = cache_case.lt.model
    V = cache_case.cfg.vocab_size
    rng = np.random.default_rng(5)
    P = 9
    seq = rng.integers(0, V, size=P + 4)
    clean = Stepper(model)
    clean(seq[None, :P], np.arange(P)[None], [1])
    dirty = clean.fork()
    junk = np.concatenate([seq[P : P + 1], (seq[P + 1 : P + 4] + 1) % V])  # anchor + 3 wrong drafts
    dirty(junk[None], np.arange(P, P + 4)[None], [1])
    clean(seq[None, P : P + 1], np.array([[P]]), [1])
    for j in range(1, 4):
        lc, hc = clean(seq[None, P + j : P + j + 1], np.array([[P + j]]), [1])
        ld, hd = dirty(seq[None, P + j : P + j + 1], np.array([[P + j]]), [1])
        # a leaked stale row moves logits by O(1); 1e-5 allows a GPU's different summation order (H200 run: 1e-6)
        np.testing.assert_allclose(ld, lc, atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(hd, hc, atol=1e-5, rtol=1e-5)
