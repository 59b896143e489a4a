"""A token's raw bytes (what the logprobs `bytes` field carries): byte-level BPE through GPT-2's byte alphabet,
SentencePiece pieces (`▁` a space, `<0xNN>` byte fallback), added tokens as their text."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dflash_jax.checkpoints.tokenizer import TokenBytes, load_hf_tokenizer
from tests.tinymodels import write_byte_tokenizer


def test_byte_level_tokens_concatenate_to_the_utf8_text(tmp_path):
    write_byte_tokenizer(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    text = "Crème brûlée 你好 🚀 <|im_end|>"
    ids = tok.encode(text)
    pieces = [tok.token_bytes(i) for i in ids]
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # single bytes of multi-byte characters
    assert b"".join(pieces) == text.encode()
    assert tok.token_bytes(tok.tk.token_to_id("<|im_end|>")) == b"<|im_end|>"


def test_sentencepiece_pieces_and_byte_fallback():
    vocab = {"<unk>": 0, "\u2581hello": 1, "\u2581world": 2, "<0xE4>": 3, "<0xBD>": 4, "<0xA0>": 5, "ab": 6}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tb = TokenBytes(tk)
    assert [tb(i) for i in range(1, 7)] == [b" hello", b" world", b"\xe4", b"\xbd", b"\xa0", b"ab"]
    assert (tb(3) + tb(4) + tb(5)).decode() == "你"
