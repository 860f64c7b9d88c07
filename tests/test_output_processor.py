"""The front end's output processor: stop strings matched on incrementally decoded text (including one that
ends inside a character split over byte-level tokens), tokens after the match dropped, the engine told to
abort; streaming never sends text a stop string takes back; no whole-text re-decode per token."""

import pytest

from moe_serve.moe.tiny_tokenizer import build_tokenizer
from moe_serve.server.core.outputs import EngineOutput
from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.frontend.output_processor import RequestState

TEXT = "Tea: 日本語のテキスト, then more words after it."


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def feed(state: RequestState, ids: list[int], finish_at_end: str | None = None) -> tuple[list[bool], list[str]]:
    """One token per engine output; returns what `add` said and the streamed deltas."""
    aborts, deltas = [], []
    for i, t in enumerate(ids):
        last = finish_at_end if i == len(ids) - 1 else None
        aborts.append(state.add(EngineOutput("r", [t], None, last)))
        deltas.append(state.stream_delta())
        if state.finished:
            break
    return aborts, deltas


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ending_inside_a_split_character(tok, include):
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    assert any(p.endswith("\ufffd") for p in pieces), "the test needs a character split over tokens"
    stop = "本語"
    state = RequestState("r", None, [0], SamplingParams(max_tokens=100, stop=[stop],
                                                         include_stop_str_in_output=include), tok, stream=True)
    aborts, deltas = feed(state, ids, finish_at_end="length")
    cut = TEXT.index(stop) + (len(stop) if include else 0)
    assert state.finished and (state.finish_reason, state.stop_reason) == ("stop", stop)
    assert state.text == TEXT[:cut]
    assert aborts[-1] is True and not any(aborts[:-1])  # the engine is told once, when it matched
    assert tok.decode(state.token_ids).startswith(TEXT[:TEXT.index(stop) + len(stop)])
    assert not tok.decode(state.token_ids[:-1]).endswith(stop)  # the last token kept completed the match
    assert "".join(deltas) == state.text and not any("\ufffd" in d for d in deltas)


def test_tokens_after_the_match_in_one_output_are_dropped(tok):
    ids = tok.encode("alpha beta gamma delta", add_special_tokens=False)
    state = RequestState("r", None, [0], SamplingParams(max_tokens=100, stop=["beta"]), tok)
    assert state.add(EngineOutput("r", ids, None)) is True
    assert state.text == "alpha " and tok.decode(state.token_ids).endswith("beta")
    assert state.add(EngineOutput("r", ids[:1], None, "length")) is False  # late outputs are ignored
    assert state.finish_reason == "stop"


def test_no_stop_string_takes_the_engines_finish_and_full_decode(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    state = RequestState("r", None, [0], SamplingParams(max_tokens=len(ids)), tok, stream=True)
    aborts, deltas = feed(state, ids, finish_at_end="length")
    assert not any(aborts) and state.finish_reason == "length" and state.text == tok.decode(ids)
    assert "".join(deltas) == state.text


def test_long_generation_decodes_incrementally(tok, monkeypatch):
    """2,000 tokens with a stop string that never matches: the tokenizer's whole-sequence decode runs once (for
    the final text), never per token; the stop search looks at a bounded window."""
    ids = (tok.encode(" the router picks four experts and", add_special_tokens=False) * 400)[:2000]
    calls = []
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda *a, **k: calls.append(len(a[0])) or real(*a, **k))
    state = RequestState("r", None, [0], SamplingParams(max_tokens=2000, stop=["never appears"]), tok, stream=True)
    feed(state, ids, finish_at_end="length")
    assert state.finish_reason == "length" and len(state.token_ids) == 2000
    assert calls == [2000]
