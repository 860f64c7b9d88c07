"""Incremental detokenization for streaming: text deltas from a growing list of token ids.

Fast (Rust-backed) tokenizers stream through `tokenizers`' own `DecodeStream`, which keeps the bytes of a
character split across tokens until the token that completes it arrives. Other tokenizers decode a short
window (the last delta's tokens, the new ones) and hand out what it adds to the text already given, holding
back text that ends in U+FFFD (an incomplete UTF-8 sequence). Either way a new token costs O(1) decoding,
and the last few prompt tokens come first, so the first output token decodes as it would mid-text.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 4  # prompt tokens decoded before the first output token


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.text = ""
        context = list(prompt_token_ids[-PROMPT_CONTEXT:])
        self._rust = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if self._rust is not None:
            self._stream = DecodeStream(ids=context, skip_special_tokens=True)
        else:  # the window: ids[_start:] decoded, of which ids[_start:_given] are already in the text
            self._ids = context
            self._start, self._given = 0, len(context)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly decodable text (maybe "")."""
        if self._rust is not None:
            delta = "".join(filter(None, (self._stream.step(self._rust, t) for t in token_ids)))
        else:
            delta = self._window_delta(token_ids)
        self.text += delta
        return delta

    def _window_delta(self, token_ids: list[int]) -> str:
        self._ids.extend(token_ids)
        before = self.tokenizer.decode(self._ids[self._start:self._given], skip_special_tokens=True)
        after = self.tokenizer.decode(self._ids[self._start:], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""  # wait for the rest of a split character (or for any text at all)
        self._start, self._given = self._given, len(self._ids)
        return after[len(before):]
