"""Incremental detokenization for streaming: text deltas from a growing list of token ids.

Decodes only a short window: the tokens since the last emitted delta plus the ones before them, so each
new token costs O(1) decoding. A delta that ends in U+FFFD (an incomplete UTF-8 sequence: a byte-level
token split a character) is held back until the next token completes it. The last few prompt tokens
seed the window, so the first output token decodes as it would in the middle of text.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], context: int = 4):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-context:])
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # tokens before this are already in the text
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly decodable text (maybe "")."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta
