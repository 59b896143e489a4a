"""Target config fields as transformers writes and reads them: each case is a tiny random model saved by
transformers (`save_pretrained`; a field that tooling writes differently is edited into the saved config.json, and
the reference model is then re-read from that directory by transformers itself), loaded with our `load_target` and
compared with transformers, or refused with an error naming the field.

  * `hidden_act`: every name of transformers' ACT2FN is computed as ACT2FN computes it, or refused; gelu / tanh-gelu
    / relu2 checkpoints give HF's logits (and differ from SiLU, so the check has teeth).
  * Sliding windows (Qwen3 `use_sliding_window` + `max_window_layers` or `layer_types`, Mistral `sliding_window`):
    HF's logits, HF's greedy continuation through plain decoding and through speculative verify steps whose drafts
    are all right (so every verify row attends over the window); unsupported layouts refused by field.
  * RoPE: `rope_parameters` (transformers 5), legacy `rope_scaling` + top-level `rope_theta`, both at once, llama3's
    `original_max_position_embeddings` default, yarn (inverse frequencies and the cos/sin attention factor against
    transformers' ROPE_INIT_FUNCTIONS, and HF's logits); the inverse frequencies equal HF's; refusals name the field
    the file uses. The drafter reads `rope_parameters` too (checked against transformers' Qwen3 rotary embedding).
  * `attention_bias` / `mlp_bias` refused by field; fields left out take the defaults of transformers' config class.
  * `generate` / `bench decode` refuse `--max-tokens` past `max_position_embeddings`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax.numpy as jnp  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402

from dflash_jax.builder import Models, offline_context_len  # noqa: E402
from dflash_jax.checkpoints.drafter import drafter_config_from_hf  # noqa: E402
from dflash_jax.checkpoints.loader import load_target  # noqa: E402
from dflash_jax.config import HF_ACTIVATIONS, TargetConfig  # noqa: E402
from dflash_jax.errors import CheckpointError, UserError  # noqa: E402
from dflash_jax.models.drafter import DrafterModel, random_drafter_config  # noqa: E402
from dflash_jax.models.layers import ACTIVATIONS, RandomBuilder, rope_attention_factor, rope_inv_freq  # noqa: E402
from dflash_jax.spec_decode.oracle import GivenDraftsRunner  # noqa: E402
from dflash_jax.spec_decode.runner import SpecRunner  # noqa: E402
from dflash_jax.types import SamplingParams  # noqa: E402
from tests.checkpoints.test_loading_errors import cli_error, write_model  # noqa: E402
from tests.models.test_target_hf import LOGIT_TOL, build_hf, hf_forward, our_forward, write_tokenizer  # noqa: E402

LLAMA = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
QWEN3 = {**LLAMA, "num_hidden_layers": 3, "head_dim": 8, "rms_norm_eps": 1e-6}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 50000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 160,
}


def checkpoint(path: Path, cls_name: str, kw: dict, *, seed: int = 0, edit=None):
    """(HF model, directory): a random model saved by transformers. `edit(config_dict)` edits the saved config.json
    as a file; the returned reference is then transformers' own reading of the edited directory."""
    hf = build_hf(cls_name, kw, seed)
    hf.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path, kw["vocab_size"])
    if edit is not None:
        edit_config(path, edit)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
    return hf, path


def edit_config(path: Path, edit) -> dict:
    d = json.loads((path / "config.json").read_text())
    edit(d)
    (path / "config.json").write_text(json.dumps(d))
    return d


def edited_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    edit_config(dst, edit)
    return dst


def max_logit_diff(lt, hf, tokens: np.ndarray) -> float:
    ours, _ = our_forward(lt.model, tokens)
    ref, _ = hf_forward(hf, tokens)
    assert ref.std() > 0.5  # far from uniform, or the tolerance would say little
    return float(np.abs(ours - ref).max())


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


class OracleRunner(GivenDraftsRunner):
    """Drafts the reference continuation (`future`: prompt + reference tokens), so every draft is right and each
    verify step checks its whole width against the target."""

    future: list[int] = []

    def given_drafts(self, slot_list, width):
        out = np.zeros((len(slot_list), width - 1), np.int32)
        for i, s in enumerate(slot_list):
            start = self.slots[s].start  # the anchor's position
            nxt = self.future[start + 1 : start + width]
            out[i, : len(nxt)] = nxt
        return out


def runner_greedy(lt, prompt: list[int], n: int, future: list[int] | None = None) -> tuple[list[int], int]:
    """n greedy tokens from our runner: plain decoding, or (with `future`) speculative with oracle drafts.
    Returns (tokens, drafts accepted)."""
    if future is None:
        runner = SpecRunner(lt.model, None, max_slots=1, max_model_len=64)
    else:
        drafter = DrafterModel(random_drafter_config(lt.cfg, block_size=6), lt.cfg.hidden_size, RandomBuilder(1))
        runner = OracleRunner(lt.model, drafter, max_slots=1, max_model_len=64)
        runner.future = future
    got = runner.add_many([(0, prompt, SamplingParams())])[0].tokens[:]
    accepted = 0
    while len(got) < n:
        r = runner.step([0], {0: n - len(got)})[0]
        got += r.tokens
        accepted += r.num_accepted
    return got[:n], accepted


MINIMAL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


# ------------------------------------------------------------------------------------------------ hidden_act
def test_every_hf_activation_is_computed_as_transformers_does_or_refused():
    assert set(ACTIVATIONS) == set(HF_ACTIVATIONS)
    assert set(HF_ACTIVATIONS) <= set(ACT2FN)
    x = np.linspace(-12.0, 12.0, 4001, dtype=np.float32)
    refused = []
    for name in ACT2FN:
        if name in ACTIVATIONS:
            ref = ACT2FN[name](torch.from_numpy(x)).numpy()
            got = np.asarray(ACTIVATIONS[name](jnp.asarray(x)))
            np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5, err_msg=name)
        else:
            with pytest.raises(CheckpointError, match=f"hidden_act '{name}' is not supported"):
                TargetConfig.from_hf({**MINIMAL, "hidden_act": name})
            refused.append(name)
    assert set(refused) == {"prelu", "xielu"}  # the activations with weights of their own


@pytest.mark.parametrize(
    "cls_name, act", [("LlamaConfig", "gelu"), ("Qwen3Config", "gelu_pytorch_tanh"), ("MistralConfig", "relu2")]
)
def test_activation_checkpoints_match_hf(tmp_path, cls_name, act):
    kw = {**(QWEN3 if cls_name == "Qwen3Config" else LLAMA), "hidden_act": act}
    if cls_name == "MistralConfig":
        kw["sliding_window"] = None
    hf, path = checkpoint(tmp_path / "m", cls_name, kw, seed=3)
    lt = load_target(str(path))
    assert lt.cfg.hidden_act == act
    tokens = np.random.default_rng(0).integers(0, kw["vocab_size"], size=(2, 17))
    assert max_logit_diff(lt, hf, tokens) <= LOGIT_TOL
    silu = load_target(str(edited_copy(path, tmp_path / "silu", lambda d: d.update(hidden_act="silu"))))
    assert max_logit_diff(silu, hf, tokens) > 0.05  # running SiLU instead is caught


# ------------------------------------------------------------------------------------------------ sliding window
SLIDING = {
    # Qwen3: layers from max_window_layers on slide
    "qwen3-max-window-layers": (
        "Qwen3Config",
        {**QWEN3, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
        (0, 4, 4),
    ),
    # Qwen3 with an explicit per-layer layout
    "qwen3-layer-types": (
        "Qwen3Config",
        {
            **QWEN3,
            "use_sliding_window": True,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
        (5, 0, 5),
    ),
    # Mistral (loaded as a Llama-family target): every layer slides
    "mistral": ("MistralConfig", {**LLAMA, "sliding_window": 6}, (6, 6)),
}


def no_window(d: dict) -> None:
    d.pop("layer_types", None)
    d["use_sliding_window"] = False
    d["sliding_window"] = None


@pytest.fixture(scope="module", params=list(SLIDING), ids=list(SLIDING))
def sliding(request, tmp_path_factory):
    cls_name, kw, windows = SLIDING[request.param]
    hf, path = checkpoint(tmp_path_factory.mktemp(request.param), cls_name, kw, seed=5)
    return SimpleNamespace(name=request.param, hf=hf, path=path, lt=load_target(str(path)), windows=windows, kw=kw)


def test_sliding_window_logits_match_hf(sliding, tmp_path):
    assert sliding.lt.cfg.layer_windows == sliding.windows
    tokens = np.random.default_rng(1).integers(0, sliding.kw["vocab_size"], size=(2, 24))
    assert max_logit_diff(sliding.lt, sliding.hf, tokens) <= LOGIT_TOL
    full = load_target(str(edited_copy(sliding.path, tmp_path / "full", no_window)))
    assert full.cfg.layer_windows == ()
    assert max_logit_diff(full, sliding.hf, tokens) > 0.05  # plain causal attention is caught


@pytest.mark.parametrize("sliding", ["qwen3-max-window-layers", "mistral"], indirect=True)
def test_sliding_window_decode_and_verify_match_hf_generate(sliding):
    """Plain decoding (1-token steps against the cache) and speculative verify steps (W rows at once, every draft
    right) both give HF's 40-token greedy continuation, far past the window (two layouts; the third's forward is
    checked above)."""
    prompt = np.random.default_rng(2).integers(0, sliding.kw["vocab_size"], size=6).tolist()
    ref = hf_greedy(sliding.hf, prompt, 40)
    assert len(set(ref)) >= 4, f"degenerate reference {ref}"
    plain, _ = runner_greedy(sliding.lt, prompt, 40)
    assert plain == ref
    spec, accepted = runner_greedy(sliding.lt, prompt, 40, future=prompt + ref)
    assert spec == ref
    assert accepted >= 25  # the verify steps really checked drafts (40 tokens in <= 15 steps)


def test_sliding_layouts_transformers_would_not_apply_are_refused(tmp_path):
    qwen = transformers.Qwen3Config(
        **{**QWEN3, "layer_types": ["full_attention", "sliding_attention", "full_attention"]}
    )
    qwen.save_pretrained(str(tmp_path / "q"))  # use_sliding_window false: no window for the sliding layer
    d = json.loads((tmp_path / "q" / "config.json").read_text())
    with pytest.raises(CheckpointError, match="layer_types marks layer 1 'sliding_attention' but no window"):
        TargetConfig.from_hf(d)
    mistral = transformers.MistralConfig(**LLAMA, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    mistral.save_pretrained(str(tmp_path / "m"))
    d = json.loads((tmp_path / "m" / "config.json").read_text())
    assert d["layer_types"] == ["sliding_attention", "full_attention"]
    with pytest.raises(CheckpointError, match="layer_types is not supported for model_type 'mistral'"):
        TargetConfig.from_hf(d)
    with pytest.raises(CheckpointError, match="sliding_window must be a positive integer"):
        TargetConfig.from_hf({**d, "layer_types": None, "sliding_window": 0})


# ------------------------------------------------------------------------------------------------ RoPE
def _drop_theta_in_params(d):
    del d["rope_parameters"]["rope_theta"]
    d["rope_theta"] = 20000.0


def _legacy(d):
    del d["rope_parameters"]
    d["rope_theta"] = 20000.0
    d["rope_scaling"] = {"type": "linear", "factor": 2.0}


def _no_original_max(d):
    del d["rope_parameters"]["original_max_position_embeddings"]
    d["max_position_embeddings"] = 200


YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 2048}


def _yarn_legacy(d):
    del d["rope_parameters"]
    d["rope_theta"] = 10000.0
    d["rope_scaling"] = {"type": "yarn", "factor": 4.0, "beta_fast": 16, "original_max_position_embeddings": 64}
    d["original_max_position_embeddings"] = 1024


ROPE = {
    # transformers 5 writes rope_parameters and no top-level rope_theta
    "rope-parameters-llama3": ("LlamaConfig", LLAMA3_ROPE, None, 50000.0, "llama3"),
    # a top-level rope_theta next to rope_parameters holding the scaling: the scaling applies, with that theta
    "top-level-theta-with-rope-parameters": ("LlamaConfig", LLAMA3_ROPE, _drop_theta_in_params, 20000.0, "llama3"),
    # both thetas: the one inside rope_parameters wins
    "both-thetas": ("LlamaConfig", LLAMA3_ROPE, lambda d: d.update(rope_theta=20000.0), 50000.0, "llama3"),
    # transformers 4 files: rope_scaling (old `type` key) + top-level rope_theta
    "legacy-rope-scaling": ("LlamaConfig", LLAMA3_ROPE, _legacy, 20000.0, "linear"),
    # llama3 without original_max_position_embeddings: max_position_embeddings
    "llama3-default-original-max": ("LlamaConfig", LLAMA3_ROPE, _no_original_max, 50000.0, "llama3"),
    "qwen3-rope-parameters-default": ("Qwen3Config", {"rope_type": "default", "rope_theta": 1e6}, None, 1e6, None),
    # yarn: some frequencies interpolated, some extrapolated, some on the ramp between; cos/sin times 0.1 ln 4 + 1
    "llama-yarn": ("LlamaConfig", YARN_ROPE, None, 10000.0, "yarn"),
    "qwen3-yarn": (
        "Qwen3Config",
        {**YARN_ROPE, "rope_theta": 1e6, "original_max_position_embeddings": 4096},
        None,
        1e6,
        "yarn",
    ),  # fmt: skip
    # transformers 4 files: rope_scaling with `type`, the original length at the top level (it wins, as Phi-3's)
    "yarn-legacy-top-level-original": ("LlamaConfig", YARN_ROPE, _yarn_legacy, 10000.0, "yarn"),
}


@pytest.mark.parametrize("case", list(ROPE))
def test_rope_forms_match_hf(tmp_path, case):
    cls_name, rope, edit, theta, kind = ROPE[case]
    base = QWEN3 if cls_name == "Qwen3Config" else LLAMA
    hf, path = checkpoint(tmp_path / "m", cls_name, {**base, "rope_parameters": dict(rope)}, seed=4, edit=edit)
    saved = json.loads((path / "config.json").read_text())
    if edit is None:
        assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == theta
    lt = load_target(str(path))
    c = lt.cfg
    assert c.rope_theta == theta and (c.rope_scaling.rope_type if c.rope_scaling else None) == kind
    hf_inv = hf.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling), hf_inv, rtol=1e-6)
    assert rope_attention_factor(c.rope_scaling) == pytest.approx(hf.model.rotary_emb.attention_scaling, rel=1e-12)
    if kind == "yarn":
        assert rope_attention_factor(c.rope_scaling) > 1.1  # the logits below check it is applied
        interpolated = np.isclose(hf_inv, rope_inv_freq(c.head_dim, c.rope_theta, None) / c.rope_scaling.factor)
        assert 0 < interpolated.sum() < len(hf_inv)  # the ramp is exercised, not just one end of it
    # positions far enough that the scaled low frequencies matter
    tokens = np.random.default_rng(3).integers(0, base["vocab_size"], size=(1, 40))
    assert max_logit_diff(lt, hf, tokens) <= LOGIT_TOL
    if case == "llama3-default-original-max":
        assert c.rope_scaling.original_max_position_embeddings == 200
    if case == "yarn-legacy-top-level-original":
        assert c.rope_scaling.original_max_position_embeddings == 1024 and c.rope_scaling.beta_fast == 16


YARN_CASES = {
    "defaults": {},
    "no-truncate": {"truncate": False},
    "betas": {"beta_fast": 8, "beta_slow": 2},
    "attention-factor": {"attention_factor": 0.75},
    "mscale": {"mscale": 0.707, "mscale_all_dim": 1.0},
    "factor-from-lengths": {"factor": None, "original_max_position_embeddings": 512},
    "factor-below-one": {"factor": 1.0},
}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_parameters_equal_transformers_rope_init_function(case, arch):
    """Our yarn inverse frequencies and attention factor against transformers' ROPE_INIT_FUNCTIONS["yarn"] on the
    same config, over the parameters that change them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0, "original_max_position_embeddings": 1024}
    rope.update(YARN_CASES[case])
    rope = {k: v for k, v in rope.items() if v is not None or k == "factor"}
    base = {**(QWEN3 if arch == "qwen3" else LLAMA), "head_dim": 64, "max_position_embeddings": 8192}
    hc = (transformers.Qwen3Config if arch == "qwen3" else transformers.LlamaConfig)(**base, rope_parameters=rope)
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](hc)
    c = TargetConfig.from_hf(json.loads(hc.to_json_string()))
    assert c.rope_scaling.rope_type == "yarn"
    np.testing.assert_allclose(rope_inv_freq(c.head_dim, c.rope_theta, c.rope_scaling), hf_inv.numpy(), rtol=1e-6)
    assert rope_attention_factor(c.rope_scaling) == pytest.approx(hf_factor, rel=1e-12)


def _refusal(d: dict, match: str) -> None:
    with pytest.raises(CheckpointError, match=match):
        TargetConfig.from_hf(d)


def test_rope_refusals_name_the_field_the_file_uses(tmp_path):
    dynamic = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}
    transformers.LlamaConfig(**LLAMA, rope_parameters=dynamic).save_pretrained(str(tmp_path / "y"))
    d = json.loads((tmp_path / "y" / "config.json").read_text())
    _refusal(d, r"rope_parameters\.rope_type 'dynamic' is not supported")
    legacy = {**MINIMAL, "rope_theta": 1e4, "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    _refusal(legacy, r"rope_scaling\.type 'dynamic' is not supported")
    _refusal({**MINIMAL, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
             r"rope_parameters\.partial_rotary_factor")  # fmt: skip
    no_low = {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}
    _refusal({**MINIMAL, "rope_parameters": no_low}, r"rope_parameters\.low_freq_factor is missing")
    _refusal({**MINIMAL, "rope_scaling": {"rope_type": "linear"}}, r"rope_scaling\.factor is missing")
    per_type = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    _refusal({**MINIMAL, "layer_types": ["full_attention"] * 2, "rope_parameters": per_type}, "per layer type")


def _drafter_config(tmp_path: Path, rope: dict) -> tuple[dict, transformers.Qwen3Config]:
    """A z-lab-style drafter config.json (a Qwen3Config with the DFlash fields) saved by transformers."""
    qc = transformers.Qwen3Config(
        **{**QWEN3, "num_hidden_layers": 1},
        rope_parameters=dict(rope),
        architectures=["DFlashDraftModel"],
        block_size=4,
        num_target_layers=3,
        dflash_config={"mask_token_id": 5, "target_layer_ids": [0, 1], "block_size": 4},
    )
    qc.save_pretrained(str(tmp_path))
    return json.loads((tmp_path / "config.json").read_text()), transformers.Qwen3Config.from_pretrained(str(tmp_path))


@pytest.mark.parametrize(
    "rope",
    [{"rope_type": "default", "rope_theta": 1e6}, LLAMA3_ROPE, {**YARN_ROPE, "original_max_position_embeddings": 64}],
    ids=["default", "llama3", "yarn"],
)
def test_drafter_reads_rope_parameters(tmp_path, rope):
    d, qc = _drafter_config(tmp_path, rope)
    assert "rope_theta" not in d  # transformers 5 writes it inside rope_parameters only
    dc = drafter_config_from_hf(d, "drafter")
    assert dc.rope_theta == rope["rope_theta"]
    hf_rope = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(qc)
    np.testing.assert_allclose(rope_inv_freq(dc.head_dim, dc.rope_theta, dc.rope_scaling), hf_rope.inv_freq, rtol=1e-6)
    assert rope_attention_factor(dc.rope_scaling) == pytest.approx(hf_rope.attention_scaling, rel=1e-12)
    assert (dc.rope_scaling.rope_type if dc.rope_scaling else "default") == rope["rope_type"]


def test_drafter_rope_refusal_names_the_field(tmp_path):
    d, _ = _drafter_config(tmp_path, {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(CheckpointError, match=r"drafter: rope_parameters\.rope_type 'dynamic' is not supported"):
        drafter_config_from_hf(d, "drafter")


# ------------------------------------------------------------------------------------------------ biases, defaults
@pytest.mark.parametrize(
    "cls_name, field_name",
    [("LlamaConfig", "attention_bias"), ("LlamaConfig", "mlp_bias"), ("Qwen3Config", "attention_bias")],
)
def test_bias_checkpoints_are_refused_by_field(tmp_path, cls_name, field_name):
    kw = {**(QWEN3 if cls_name == "Qwen3Config" else LLAMA), field_name: True}
    _, path = checkpoint(tmp_path / "m", cls_name, kw)
    with pytest.raises(CheckpointError, match=f"{field_name}: true .* is not supported"):
        load_target(str(path))


@pytest.mark.parametrize(
    "d",
    [
        MINIMAL,  # Llama: kv heads = heads, head_dim = hidden / heads, 2048 positions
        {**MINIMAL, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "num_attention_heads": 8},
        {**MINIMAL, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_attention_heads": 32},
        {
            **MINIMAL,
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "num_attention_heads": 32,
            "use_sliding_window": True,
            "max_window_layers": 1,
            "num_hidden_layers": 3,
        },  # fmt: skip
    ],
    ids=["llama", "mistral", "qwen3", "qwen3-sliding"],
)
def test_fields_left_out_take_the_transformers_config_class_defaults(d):
    hc = transformers.AutoConfig.for_model(d["model_type"], **{k: v for k, v in d.items() if k != "model_type"})
    c = TargetConfig.from_hf(d)
    assert c.num_kv_heads == hc.num_key_value_heads
    assert c.head_dim == (getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads)
    assert c.max_position_embeddings == hc.max_position_embeddings
    assert c.rope_theta == hc.rope_parameters["rope_theta"] and c.rope_scaling is None
    window = getattr(hc, "sliding_window", None)  # (LlamaConfig has none)
    types = getattr(hc, "layer_types", None) or ["sliding_attention" if window else "full_attention"] * c.num_layers
    want = tuple(window if t == "sliding_attention" else 0 for t in types)
    assert c.layer_windows == (want if any(want) else ())


# ------------------------------------------------------------------------------------------------ max positions
def test_offline_context_is_refused_past_max_position_embeddings():
    models = Models(SimpleNamespace(cfg=SimpleNamespace(max_position_embeddings=128)), None, None)
    assert offline_context_len(models, 20, 100) == 128  # fits; the spare positions stop at the model's limit
    assert offline_context_len(models, 20, 50) == 78
    with pytest.raises(UserError, match=r"--max-tokens 120 is 140 positions, .*max_position_embeddings \(128\)"):
        offline_context_len(models, 20, 120)
    with pytest.raises(UserError, match="shorten the prompt"):
        offline_context_len(models, 130, 1)


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_generate_and_bench_refuse_max_tokens_past_the_model(tmp_path, command):
    model = str(write_model(tmp_path / "target"))  # max_position_embeddings 128
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "w3 w4 w5"}) + "\n")
    args = {
        "generate": ["generate", "--prompt", "w3 w4 w5"],
        "bench": ["bench", "decode", "--draft-model", "random:1", "--prompts", str(prompts)],
    }[command]
    line = cli_error([*args, "--model", model, "--max-tokens", "200"])
    assert line.startswith("error: --max-tokens:") and "max_position_embeddings (128)" in line, line
