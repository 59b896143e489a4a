"""Tokenizers (HF `tokenizer.json` or rebuilt from GGUF metadata) and Jinja chat templates."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from dflash_jax.errors import CheckpointError, UserError

CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The template variables the renderer sets (chat_template_kwargs cannot override them).
TEMPLATE_VARIABLES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")

# `--tool-call-parser`: the format of the model's tool calls (`server.tools`). hermes: Hermes / Qwen2.5 / Qwen3
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; llama3: Llama 3.x JSON `{"name": ..., "parameters":
# {...}}` (optionally after `<|python_tag|>`, several separated by `;`); auto: the one the chat template shows.
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3")
# What each format's chat templates contain (Qwen2.5 / Qwen3 / Hermes 2 Pro: the tags; Llama 3.1-3.3: the ipython
# role and the python tag).
_TOOL_FORMAT_MARKS = {"hermes": ("<tool_call>",), "llama3": ("<|python_tag|>", "ipython")}


def template_tool_format(template: str | None) -> str | None:
    """The tool-call format a chat template renders (hermes or llama3), or None when it shows neither."""
    for fmt, marks in _TOOL_FORMAT_MARKS.items():
        if template and any(m in template for m in marks):
            return fmt
    return None


def resolve_tool_call_parser(asked: str, template: str | None) -> str:
    """`--tool-call-parser` resolved against the served chat template: `auto` is the template's format (hermes when
    it shows none: such a template does not render tools in a format of its own); an explicit parser that
    contradicts the template's format is refused, since every call the model makes would stay plain content."""
    if asked not in TOOL_CALL_PARSERS:
        raise UserError(
            f"--tool-call-parser: must be one of {', '.join(TOOL_CALL_PARSERS)}, got {asked!r}",
            param="--tool-call-parser",
        )
    shown = template_tool_format(template)
    if asked == "auto":
        return shown or "hermes"
    if shown is not None and shown != asked:
        raise UserError(
            f"--tool-call-parser {asked}: the chat template renders {shown} tool calls, which this parser would "
            f"leave as plain content; drop the flag (auto) or give --tool-call-parser {shown}",
            param="--tool-call-parser",
        )
    return asked


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a byte-level BPE vocab."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """The raw UTF-8 bytes of single tokens of a `tokenizers.Tokenizer` (what OpenAI's logprobs `bytes` carry; a
    token may hold part of a character): byte-level BPE pieces through GPT-2's byte alphabet, SentencePiece pieces
    with `▁` as a space and `<0xNN>` byte-fallback pieces as that byte, added tokens as their text."""

    def __init__(self, tk: Tokenizer):
        dec = json.loads(tk.to_str()).get("decoder") or {}
        kinds = {dec.get("type")} | {d.get("type") for d in dec.get("decoders") or []}
        self._byte_level = "ByteLevel" in kinds
        self._added = {int(i): t.content for i, t in tk.get_added_tokens_decoder().items()}
        self._tk = tk
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        out = self._cache.get(token_id)
        if out is None:
            out = self._cache[token_id] = self._bytes(token_id)
        return out

    def _bytes(self, token_id: int) -> bytes:
        if token_id in self._added:
            return self._added[token_id].encode()
        piece = self._tk.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            alphabet = _byte_level_alphabet()
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode()


class TextTokenizer:
    """encode/decode plus the chat template, with the special-token ids the engine needs."""

    def __init__(
        self,
        tk: Tokenizer,
        *,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
        add_bos: bool = False,
        extra_eos_ids: tuple[int, ...] = (),
        pad_token: str | None = None,
    ):
        self.tk = tk
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.add_bos = add_bos
        self.bos_token_id = tk.token_to_id(bos_token) if bos_token else None
        eos = {tk.token_to_id(eos_token)} if eos_token and tk.token_to_id(eos_token) is not None else set()
        self.eos_token_ids: set[int] = eos | set(extra_eos_ids)
        self._template = None
        self._token_bytes: TokenBytes | None = None

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (see `TokenBytes`)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tk)
        return self._token_bytes(token_id)

    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    @property
    def rendered_template(self) -> str:
        """The chat template `apply_chat_template` renders (ChatML where the model has none)."""
        return self.chat_template or CHATML_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.tk.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """Render the chat template. `chat_template_kwargs` are extra template variables (e.g. `enable_thinking`
        of Qwen3 templates), as in transformers' `apply_chat_template(..., **kwargs)`; the names the renderer sets
        itself cannot be given."""
        if not messages:
            raise UserError("messages must not be empty", param="messages")
        extra = dict(chat_template_kwargs or {})
        taken = sorted(set(extra) & set(TEMPLATE_VARIABLES))
        if taken:
            raise UserError(
                f"chat_template_kwargs: {', '.join(repr(k) for k in taken)} cannot be given here "
                f"(the renderer sets {', '.join(TEMPLATE_VARIABLES)} itself)",
                param="chat_template_kwargs",
            )
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

            def raise_exception(msg):
                raise UserError(f"chat template: {msg}", param="messages")

            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
            self._template = env.from_string(self.rendered_template)
        try:
            return self._template.render(
                **extra,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise UserError(f"chat template failed to render: {e}", param="messages") from None

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        # The rendered template already contains any BOS it wants.
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


def load_hf_tokenizer(path: Path) -> TextTokenizer:
    tj = path / "tokenizer.json"
    if not tj.exists():
        raise CheckpointError(f"{path}: no tokenizer.json (a Hugging Face tokenizer file is required)")
    try:
        tk = Tokenizer.from_file(str(tj))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise CheckpointError(f"{tj}: cannot read tokenizer ({e})") from None
    cfg: dict[str, Any] = {}
    tc = path / "tokenizer_config.json"
    if tc.exists():
        cfg = json.loads(tc.read_text())

    def tok_str(v):
        if isinstance(v, dict):
            return v.get("content")
        return v

    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    ct = path / "chat_template.jinja"
    if template is None and ct.exists():
        template = ct.read_text()
    gen_eos: tuple[int, ...] = ()
    gc = path / "generation_config.json"
    if gc.exists():
        e = json.loads(gc.read_text()).get("eos_token_id")
        gen_eos = tuple(e) if isinstance(e, list) else ((e,) if isinstance(e, int) else ())
    return TextTokenizer(
        tk,
        chat_template=template,
        bos_token=tok_str(cfg.get("bos_token")),
        eos_token=tok_str(cfg.get("eos_token")),
        add_bos=bool(cfg.get("add_bos_token", False)),
        extra_eos_ids=gen_eos,
        pad_token=tok_str(cfg.get("pad_token")),
    )


def tokenizer_from_gguf_fields(fields: dict[str, Any]) -> TextTokenizer:
    """Rebuild a byte-level BPE tokenizer (`tokenizer.ggml.model = gpt2`) from GGUF metadata."""
    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise CheckpointError(f"GGUF: tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE)")
    tokens: list[str] = fields["tokenizer.ggml.tokens"]
    merges: list[str] = fields.get("tokenizer.ggml.merges", [])
    types: list[int] = fields.get("tokenizer.ggml.token_type", [1] * len(tokens))
    tk = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=[tuple(m.split(" ", 1)) for m in merges],
        )
    )
    pre = fields.get("tokenizer.ggml.pre", "default")
    seq = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    if pre in ("smollm", "qwen2", "llama-bpe", "default", "gpt-2", "starcoder"):
        if pre in ("smollm", "starcoder"):
            seq.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence(seq)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in range(len(tokens)) if types[i] == 3]
    )

    def tok(key):
        i = fields.get(key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    return TextTokenizer(
        tk,
        chat_template=fields.get("tokenizer.chat_template"),
        bos_token=tok("tokenizer.ggml.bos_token_id"),
        eos_token=tok("tokenizer.ggml.eos_token_id"),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", False)),
    )
