"""`chat_template_kwargs` reach the chat template as extra variables, rendered as transformers renders them
(`apply_chat_template(..., **kwargs)` of a tokenizer saved the way transformers saves one)."""

from __future__ import annotations

import json

import pytest

from dflash_jax.checkpoints.tokenizer import load_hf_tokenizer
from dflash_jax.errors import UserError
from tests.tinymodels import write_byte_tokenizer

# Qwen3-style: with enable_thinking false the answer opens with an empty think block; `extra_note` shows any
# variable passes through.
TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- if extra_note is defined %}{{- '[' + extra_note + ']' }}{%- endif %}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_byte_tokenizer(path)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize(
    "kwargs", [{}, {"enable_thinking": False}, {"enable_thinking": True}, {"extra_note": "x", "enable_thinking": False}]
)
def test_kwargs_render_as_transformers_renders_them(tok_dir, kwargs):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
    got = load_hf_tokenizer(tok_dir).apply_chat_template(MESSAGES, True, chat_template_kwargs=kwargs)
    assert got == want
    assert ("<think>" in got) == (kwargs.get("enable_thinking") is False)


def test_the_renderers_own_variables_cannot_be_overridden(tok_dir):
    tok = load_hf_tokenizer(tok_dir)
    with pytest.raises(UserError, match="add_generation_prompt") as e:
        tok.apply_chat_template(MESSAGES, True, chat_template_kwargs={"add_generation_prompt": False})
    assert e.value.param == "chat_template_kwargs"
