"""Bad checkpoints are refused with one clear line that names the problem.

Target: `dflash-jax info --model X` on a missing path, a directory without config.json, an unsupported
architecture, a corrupt or truncated safetensors file, a missing / extra / mis-shaped tensor, ... prints exactly one
line `error: ...` naming the thing, exits non-zero, and shows no traceback.

Drafter: `load_drafter` refuses a checkpoint with a missing tensor, a wrong `fc` width, a hidden size
unlike the target's, or a `mask_token_id` outside the target vocabulary, with a message naming it (and the CLI
turns that into the same one-line error).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers
from typer.testing import CliRunner

from dflash_jax.checkpoints.drafter import load_drafter
from dflash_jax.checkpoints.export import export_drafter
from dflash_jax.cli.main import app
from dflash_jax.errors import CheckpointError
from dflash_jax.testing.waits import run

# ------------------------------------------------------------------------------------------- a tiny HF dir
V, H, I, L, NH, NKV, HD = 64, 32, 48, 2, 4, 2, 8

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": V,
    "hidden_size": H,
    "intermediate_size": I,
    "num_hidden_layers": L,
    "num_attention_heads": NH,
    "num_key_value_heads": NKV,
    "head_dim": HD,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 128,
}


def hf_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def m(*shape):
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": m(V, H), "model.norm.weight": np.ones(H, np.float32), "lm_head.weight": m(V, H)}
    for i in range(L):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(H, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(H, np.float32)
        t[p + "self_attn.q_proj.weight"] = m(NH * HD, H)
        t[p + "self_attn.k_proj.weight"] = m(NKV * HD, H)
        t[p + "self_attn.v_proj.weight"] = m(NKV * HD, H)
        t[p + "self_attn.o_proj.weight"] = m(H, NH * HD)
        t[p + "mlp.gate_proj.weight"] = m(I, H)
        t[p + "mlp.up_proj.weight"] = m(I, H)
        t[p + "mlp.down_proj.weight"] = m(H, I)
    return t


def write_model(path: Path, *, config: dict | None = None, tensors: dict[str, np.ndarray] | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    save_file(hf_tensors() if tensors is None else tensors, str(path / "model.safetensors"))
    tk = Tokenizer(models.WordLevel(vocab={f"w{i}": i for i in range(V)}, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.save(str(path / "tokenizer.json"))
    return path


def cli_error(args: list[str]) -> str:
    """Run the CLI; assert it failed the user-error way and return its single `error: ...` line."""
    res = CliRunner().invoke(app, args)
    # An uncaught exception would be a traceback on a real terminal; CliRunner stores it in res.exception.
    assert isinstance(res.exception, SystemExit), f"uncaught {res.exception!r}\n{res.output}"
    assert res.exit_code != 0
    assert "Traceback" not in res.output
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------- target errors
def test_valid_tiny_model_is_accepted(tmp_path):
    """The control: the same directory, unbroken, loads and `info` describes it."""
    res = CliRunner().invoke(app, ["info", "--model", str(write_model(tmp_path / "ok"))])
    assert res.exit_code == 0, res.output
    assert "architecture llama: 2 layers, hidden 32" in res.stdout


def test_missing_path(tmp_path):
    line = cli_error(["info", "--model", str(tmp_path / "no-such-model")])
    assert "no-such-model" in line and "does not exist" in line


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    line = cli_error(["info", "--model", str(tmp_path / "empty")])
    assert "config.json" in line and "empty" in line


def test_unsupported_architecture(tmp_path):
    path = write_model(tmp_path / "gpt2", config={**CONFIG, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    line = cli_error(["info", "--model", str(path)])
    assert "unsupported architecture" in line and "GPT2LMHeadModel" in line


def test_invalid_config_json(tmp_path):
    path = write_model(tmp_path / "badjson")
    (path / "config.json").write_text("{not json")
    line = cli_error(["info", "--model", str(path)])
    assert "config.json" in line and "JSON" in line


def test_config_missing_field(tmp_path):
    path = write_model(tmp_path / "nofield", config={k: v for k, v in CONFIG.items() if k != "hidden_size"})
    assert "hidden_size" in cli_error(["info", "--model", str(path)])


def test_corrupt_safetensors(tmp_path):
    path = write_model(tmp_path / "corrupt")
    (path / "model.safetensors").write_bytes(b"\x13\x00\x00\x00\x00\x00\x00\x00{garbage" + os.urandom(64))
    line = cli_error(["info", "--model", str(path)])
    assert "model.safetensors" in line and "corrupt" in line


def test_truncated_safetensors(tmp_path):
    path = write_model(tmp_path / "truncated")
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    line = cli_error(["info", "--model", str(path)])
    assert "model.safetensors" in line and "corrupt" in line


def test_missing_tensor(tmp_path):
    t = hf_tensors()
    del t["model.layers.1.mlp.up_proj.weight"]
    line = cli_error(["info", "--model", str(write_model(tmp_path / "missing", tensors=t))])
    assert "missing" in line and "layers.1.mlp.up_proj.weight" in line


def test_extra_tensor(tmp_path):
    t = hf_tensors()
    t["model.layers.0.self_attn.mystery.weight"] = np.zeros((4, 4), np.float32)
    line = cli_error(["info", "--model", str(write_model(tmp_path / "extra", tensors=t))])
    assert "model.layers.0.self_attn.mystery.weight" in line


def test_misshaped_tensor(tmp_path):
    t = hf_tensors()
    t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((NH * HD, H), np.float32)  # q-sized: MHA, not GQA
    line = cli_error(["info", "--model", str(write_model(tmp_path / "shape", tensors=t))])
    assert "layers.0.self_attn.k_proj.weight" in line and "shape" in line


def test_index_lists_a_missing_shard(tmp_path):
    path = write_model(tmp_path / "sharded")
    t = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = sorted(t)
    save_file({k: t[k] for k in names[::2]}, str(path / "model-00001-of-00002.safetensors"))
    weight_map = {k: f"model-0000{1 + j % 2}-of-00002.safetensors" for j, k in enumerate(names)}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    line = cli_error(["info", "--model", str(path)])
    assert "model-00002-of-00002.safetensors" in line


def test_missing_tokenizer(tmp_path):
    path = write_model(tmp_path / "notok")
    (path / "tokenizer.json").unlink()
    assert "tokenizer.json" in cli_error(["info", "--model", str(path)])


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    line = cli_error(["info", "--model", str(f)])
    assert "weights.bin" in line and "gguf" in line.lower()


def test_corrupt_gguf(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + os.urandom(40))
    line = cli_error(["info", "--model", str(f)])
    assert "broken.gguf" in line and "GGUF" in line


def test_real_process_prints_one_line_and_no_traceback(tmp_path):
    """The installed entry point, as a user runs it: corrupt weights -> one stderr line, exit code 2."""
    path = write_model(tmp_path / "corrupt-proc")
    (path / "model.safetensors").write_bytes(b"not a safetensors file at all")
    exe = Path(sys.executable).with_name("dflash-jax")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-c", "from dflash_jax.cli.main import app; app()"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = run([*cmd, "info", "--model", str(path)], env=env)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "model.safetensors" in lines[0], proc.stderr


# ------------------------------------------------------------------------------------------- drafter refusals
@pytest.fixture
def drafter_dir(tmp_path, tiny_llama_cfg, drafter_factory):
    """A valid z-lab-layout drafter checkpoint for the tiny Llama target, plus the model it came from."""
    model = drafter_factory(tiny_llama_cfg)
    path = export_drafter(model, tmp_path / "drafter", tiny_llama_cfg.num_layers)
    return path, model


def edit_config(path: Path, fn) -> None:
    cfg = json.loads((path / "config.json").read_text())
    fn(cfg)
    (path / "config.json").write_text(json.dumps(cfg))


def edit_tensors(path: Path, fn) -> None:
    t = load_file(str(path / "model.safetensors"))
    fn(t)
    save_file(t, str(path / "model.safetensors"))


def test_drafter_round_trip_is_accepted(drafter_dir, tiny_llama_cfg):
    """The control: the exported checkpoint loads (also with z-lab's optional `model.` prefix) to the same
    parameters."""
    path, model = drafter_dir
    ref = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for prefixed in (False, True):
        if prefixed:
            edit_tensors(path, lambda t: t.update({"model." + k: t.pop(k) for k in list(t)}))
        got = load_drafter(path, tiny_llama_cfg)
        assert got.cfg == model.cfg
        flat = dict(nnx.to_flat_state(nnx.state(got, nnx.Param)))
        assert flat.keys() == ref.keys()
        for k in ref:
            np.testing.assert_array_equal(np.asarray(flat[k][...]), np.asarray(ref[k][...]), err_msg=str(k))


def test_drafter_missing_tensor(drafter_dir, tiny_llama_cfg):
    path, _ = drafter_dir
    edit_tensors(path, lambda t: t.pop("layers.1.self_attn.k_norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'layers\.1\.self_attn\.k_norm\.weight'"):
        load_drafter(path, tiny_llama_cfg)


def test_drafter_extra_tensor(drafter_dir, tiny_llama_cfg):
    path, _ = drafter_dir
    edit_tensors(path, lambda t: t.update({"layers.0.self_attn.q_bias": np.zeros(4, np.float32)}))
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.q_bias"):
        load_drafter(path, tiny_llama_cfg)


def test_drafter_wrong_fc_width(drafter_dir, tiny_llama_cfg):
    """fc must read len(target_layer_ids) * target hidden features: 3 taps' width with 2 taps is refused, the
    shapes given as the file stores them ([out, in])."""
    path, model = drafter_dir
    h = tiny_llama_cfg.hidden_size
    assert model.cfg.num_taps == 2
    edit_tensors(path, lambda t: t.update({"fc.weight": np.zeros((model.cfg.hidden_size, 3 * h), np.float32)}))
    with pytest.raises(CheckpointError, match=rf"'fc\.weight' has shape \[{h}, {3 * h}\], expected \[{h}, {2 * h}\]"):
        load_drafter(path, tiny_llama_cfg)


def test_drafter_hidden_size_unlike_target(tmp_path, tiny_llama_cfg, drafter_factory):
    """A self-consistent drafter with hidden 48 for a hidden-64 target: refused naming both sizes."""
    model = drafter_factory(tiny_llama_cfg, hidden_size=48)
    path = export_drafter(model, tmp_path / "h48", tiny_llama_cfg.num_layers)
    with pytest.raises(CheckpointError, match=r"hidden_size 48 .*hidden_size 64"):
        load_drafter(path, tiny_llama_cfg)


def test_drafter_mask_token_outside_vocab(drafter_dir, tiny_llama_cfg):
    path, _ = drafter_dir
    v = tiny_llama_cfg.vocab_size
    edit_config(path, lambda c: c["dflash_config"].update(mask_token_id=v))
    with pytest.raises(CheckpointError, match=rf"mask_token_id {v} is outside the target vocabulary"):
        load_drafter(path, tiny_llama_cfg)
    edit_config(path, lambda c: c["dflash_config"].update(mask_token_id=-1))
    with pytest.raises(CheckpointError, match=r"mask_token_id -1"):
        load_drafter(path, tiny_llama_cfg)


def test_drafter_target_layer_out_of_range(drafter_dir, tiny_llama_cfg):
    path, _ = drafter_dir
    edit_config(path, lambda c: c["dflash_config"].update(target_layer_ids=[0, tiny_llama_cfg.num_layers]))
    with pytest.raises(CheckpointError, match=rf"target_layer_ids contains {tiny_llama_cfg.num_layers}"):
        load_drafter(path, tiny_llama_cfg)


def test_drafter_config_without_mask_token_or_wrong_architecture(drafter_dir, tiny_llama_cfg):
    path, _ = drafter_dir
    edit_config(path, lambda c: c["dflash_config"].pop("mask_token_id"))
    with pytest.raises(CheckpointError, match=r"mask_token_id"):
        load_drafter(path, tiny_llama_cfg)
    edit_config(path, lambda c: c.update(architectures=["Qwen3ForCausalLM"]))
    with pytest.raises(CheckpointError, match=r"Qwen3ForCausalLM.*DFlashDraftModel"):
        load_drafter(path, tiny_llama_cfg)


def test_drafter_refusal_through_the_cli(tmp_path, tiny_llama_cfg, drafter_factory):
    """`generate --draft-model BAD` on a tiny target: the same one-line error, naming mask_token_id."""
    target = write_model(tmp_path / "target")
    tcfg = dataclasses.replace(tiny_llama_cfg, vocab_size=V, hidden_size=H, num_layers=L)
    path = export_drafter(drafter_factory(tcfg, target_layer_ids=(0, 1)), tmp_path / "drafter", L)
    edit_config(path, lambda c: c["dflash_config"].update(mask_token_id=V + 5))
    line = cli_error(
        ["generate", "--model", str(target), "--draft-model", str(path), "--prompt", "w3 w4", "--max-tokens", "2"]
    )
    assert f"mask_token_id {V + 5}" in line and str(path) in line
