"""Constrained decoding: a request's `structured_output` becomes a grammar, and the sampler only sees the
tokens that grammar allows next.

A spec is a dict with exactly one key (`check_spec` says which are valid): `json` (a JSON schema, as text or
a dict), `json_object` (any JSON object), `regex`, `choice` (a list of strings: the output is one of them),
`grammar` (EBNF, xgrammar's dialect) or `tagged_json` ({begin, end, options: [{prefix, schema, suffix}]}:
begin, then one option's prefix, a JSON value of its schema and its suffix, then end; what a tool call is). xgrammar compiles it against the model's vocabulary once per
distinct spec (its compiler caches); each constrained request holds a matcher that every sampled token
advances, and the sampler masks the logits of its row with the matcher's next-token bitmask (filled in a
worker thread while the model's forward pass runs: server/core/runner.py).

Valid, not only grammatical, output from a weak model: JSON is compiled without free whitespace (one space
after ':' and ',' and nothing else), and in JSON modes tokens holding a raw control character (below 0x20)
are never allowed, since JSON strings must escape them, nor bytes that would spell a UTF-16 surrogate. The grammar's end lets only the EOS token through;
the engine finishes a request whose matcher has terminated.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar", "tagged_json")


def check_spec(spec: object) -> None:
    """The shape of a structured_output spec (what can be checked without compiling it); ValueError if wrong."""
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KINDS:
        raise ValueError(f"structured_output must be an object with exactly one of {list(KINDS)}, got {spec!r}")
    kind, value = next(iter(spec.items()))
    ok = {"json": isinstance(value, (str, dict)), "json_object": value is True, "regex": isinstance(value, str),
          "grammar": isinstance(value, str),
          "choice": isinstance(value, list) and value and all(isinstance(c, str) and c for c in value),
          "tagged_json": isinstance(value, dict) and isinstance(value.get("begin"), str)
          and isinstance(value.get("end"), str) and isinstance(value.get("options"), list) and value["options"]
          and all(isinstance(o, dict) and isinstance(o.get("prefix"), str) and isinstance(o.get("suffix"), str)
                  and isinstance(o.get("schema"), dict) for o in value["options"])}[kind]
    if not ok:
        want = {"json": "a JSON schema (object or text)", "json_object": "true", "regex": "a regular expression",
                "grammar": "an EBNF grammar", "choice": "a non-empty list of non-empty strings",
                "tagged_json": "{begin, end, options: [{prefix, schema, suffix}, ...]}"}[kind]
        raise ValueError(f"structured_output.{kind} must be {want}, got {value!r}")


def _ebnf_literal(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\r", "\\r") + '"'


def grammar_of(spec: dict):
    """The xgrammar Grammar of a spec (no vocabulary needed): raises ValueError naming what is wrong."""
    import xgrammar as xgr

    check_spec(spec)
    kind, value = next(iter(spec.items()))
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(value if isinstance(value, str) else json.dumps(value),
                                                any_whitespace=False)
        if kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_literal(c) for c in value))
        if kind == "tagged_json":
            def literal(text: str):
                return xgr.Grammar.from_ebnf("root ::= " + _ebnf_literal(text)) if text else None

            def seq(*parts):
                parts = [p for p in parts if p is not None]
                return parts[0] if len(parts) == 1 else xgr.Grammar.concat(*parts)

            options = [seq(literal(o["prefix"]), xgr.Grammar.from_json_schema(json.dumps(o["schema"]),
                                                                           any_whitespace=False), literal(o["suffix"]))
                       for o in value["options"]]
            return seq(literal(value["begin"]), options[0] if len(options) == 1 else xgr.Grammar.union(*options),
                       literal(value["end"]))
        return xgr.Grammar.from_ebnf(value)
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"structured_output.{kind} cannot be compiled: {reason}") from None


class StructuredOutputs:
    """The engine's grammar side: one compiler for the model's vocabulary, matchers per request, masks per step."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_id: int):
        self.model_dir, self.vocab_size, self.eos_token_id = str(model_dir), vocab_size, eos_token_id
        self._compiler = None
        self._json_ban_ids = self._after_ed_ban_ids = None  # set up with the compiler (see _setup)
        self._ends_in_ed: set[int] = set()
        self._lock = threading.Lock()

    def _setup(self) -> None:
        """On the first constrained request: the tokenizer's vocabulary for xgrammar, and the tokens JSON output
        must never contain: a raw control character (JSON strings escape them), or a UTF-16 surrogate's UTF-8
        form (ED A0-BF: not Unicode text, yet xgrammar's character classes let it through)."""
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                  stop_token_ids=[self.eos_token_id])
        self._compiler = xgr.GrammarCompiler(info)
        banned, continues_surrogate, self._ends_in_ed = [], [], set()
        for token_id, raw in enumerate(info.decoded_vocab[:self.vocab_size]):
            if token_id in info.special_token_ids or not raw:
                continue
            if any(b < 0x20 for b in raw) or any(a == 0xED and 0xA0 <= b <= 0xBF for a, b in zip(raw, raw[1:])):
                banned.append(token_id)
            if 0xA0 <= raw[0] <= 0xBF:
                continues_surrogate.append(token_id)  # after a token that ends in byte ED
            if raw[-1] == 0xED:
                self._ends_in_ed.add(token_id)
        self._json_ban_ids = torch.tensor(banned, dtype=torch.long)
        self._after_ed_ban_ids = torch.tensor(banned + continues_surrogate, dtype=torch.long)

    def matcher(self, spec: dict) -> "Matcher":
        with self._lock:
            if self._compiler is None:
                self._setup()
            import xgrammar as xgr

            compiled = self._compiler.compile_grammar(grammar_of(spec))
            return Matcher(xgr.GrammarMatcher(compiled), spec_is_json=next(iter(spec)) in ("json", "json_object"))

    def fill(self, rows: list[int], matchers: list["Matcher"], num_rows: int) -> tuple[torch.Tensor, list]:
        """The next-token bitmask [num_rows, ceil(V / 32)] int32 with row rows[i] filled by matchers[i], and per
        matcher the token ids JSON output must not take next (None for other grammars)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        bans = []
        for row, m in zip(rows, matchers):
            m.xgr.fill_next_token_bitmask(bitmask, row)
            bans.append(None if not m.is_json else
                        self._after_ed_ban_ids if m.last_token in self._ends_in_ed else self._json_ban_ids)
        return bitmask, bans

    def apply(self, logits_BV: torch.Tensor, rows: list[int], bitmask: torch.Tensor,
              bans: list[torch.Tensor | None]) -> None:
        """Mask rows `rows` of the logits in place (-inf where the grammar forbids the token)."""
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits_BV, bitmask, vocab_size=self.vocab_size, indices=rows)
        for row, ban in zip(rows, bans):
            if ban is not None and ban.numel():
                logits_BV[row, ban] = float("-inf")


class Matcher:
    """One request's grammar state."""

    def __init__(self, matcher, spec_is_json: bool):
        self.xgr, self.is_json = matcher, spec_is_json
        self.last_token: int | None = None

    def accept(self, token_id: int) -> None:
        if not self.xgr.accept_token(token_id):
            raise ValueError(f"token {token_id} does not fit the request's structured_output grammar")
        self.last_token = token_id

    @property
    def terminated(self) -> bool:
        return self.xgr.is_terminated()
