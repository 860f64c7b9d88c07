"""Streaming detokenization: the deltas of one token at a time add up to the whole decoded text, and a
character split over several byte-level tokens comes out whole (never as U+FFFD), on both paths
(`tokenizers`' DecodeStream for fast tokenizers, the decode window for others)."""

import pytest

from moe_serve.moe.tiny_tokenizer import build_tokenizer
from moe_serve.server.frontend.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world!", "héllo wörld: 日本語のテキスト and emoji 🙂🙃 done", " leading space and\nnew lines\n"]


class SlowView:
    """The same tokenizer seen as a slow one (no Rust backend exposed)."""
    is_fast = False

    def __init__(self, tok):
        self.decode = tok.decode


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.mark.parametrize("slow", [False, True])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_the_decoded_text(tok, text, slow):
    prompt = tok.encode("Some prompt before it:", add_special_tokens=True)
    out = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(SlowView(tok) if slow else tok, prompt)
    deltas = [detok.add([t]) for t in out]
    assert "".join(deltas) == detok.text == tok.decode(out, skip_special_tokens=True)
    assert not any("\ufffd" in d for d in deltas)
    if any(ord(c) > 0x7ff for c in text):  # some characters span several tokens: some steps emit nothing
        assert "" in deltas


def test_several_tokens_at_once_and_special_tokens_skipped(tok):
    out = tok.encode("two tokens at a time, ünïcode", add_special_tokens=False) + [tok.eos_token_id]
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.add(out[i:i + 2]) for i in range(0, len(out), 2))
    assert text == tok.decode(out, skip_special_tokens=True)
