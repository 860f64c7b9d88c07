import pytest

from moe_serve.server.core.request import Request, RequestStatus
from moe_serve.server.core.sampling_params import SamplingParams


def test_defaults_and_normalisation():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k) == (1, 16, 1.0, 1.0, -1)
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(**{"temperature": 0.5, "top_k": 0}).top_k == 0   # built by field name


def test_greedy():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=0.7, top_k=1).greedy
    assert not SamplingParams(temperature=0.7, top_k=2).greedy


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": -3}, "max_tokens must be at least 1, got -3"),
    ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
    ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
    ({"temperature": -0.1}, "temperature must be a finite number >= 0, got -0.1"),
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"n": 0}, "n must be at least 1, got 0"),
    ({"top_k": -2}, "top_k must be -1 or 0 (disabled) or at least 1, got -2"),
    ({"min_tokens": -1}, "min_tokens must be at least 0, got -1"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens must be at most max_tokens (10), got 20"),
    ({"logprobs": -1}, "logprobs must be in [0, 20], got -1"),
    ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
    ({"stop": ["ok", ""]}, "stop strings must be non-empty strings, got ''"),
    ({"stop_token_ids": [-5]}, "stop_token_ids must be non-negative integers, got -5"),
    ({"seed": 1.5}, "seed must be an integer or None, got 1.5"),
    ({"seed": 2**64}, "seed must fit in a signed 64-bit integer"),
    ({"top_k": -2**70}, "top_k must fit in a signed 64-bit integer"),
    ({"stop_token_ids": [2**63]}, "stop_token_ids must be non-negative integers"),
])
def test_validation_messages(kwargs, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert message in str(e.value)


def test_min_tokens_without_max_tokens_is_allowed():
    assert SamplingParams(max_tokens=None, min_tokens=100).min_tokens == 100


def test_request_token_bookkeeping():
    r = Request("r", [5, 6, 7], SamplingParams(), eos_token_id=2)
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (3, 0, 3)
    r.append_output_token(9)
    assert r.all_token_ids == [5, 6, 7, 9] and r.output_token_ids == [9] and r.prompt_token_ids == [5, 6, 7]
    assert r.num_tokens - r.num_computed_tokens == 4
    assert r.status == RequestStatus.WAITING and not r.is_finished()
    with pytest.raises(ValueError, match="empty prompt"):
        Request("e", [], SamplingParams())


def test_status_helpers():
    assert RequestStatus.FINISHED_STOPPED.finish_reason == "stop"
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert RequestStatus.FINISHED_ABORTED.finish_reason == "abort"
    assert RequestStatus.RUNNING.finish_reason is None
    assert RequestStatus.is_finished(RequestStatus.FINISHED_LENGTH)
    assert not RequestStatus.is_finished(RequestStatus.PREEMPTED)


def test_tiny_temperature_is_greedy():
    """Dividing logits by a temperature below 1e-5 would overflow to inf (then NaN probabilities)."""
    assert SamplingParams(temperature=1e-300).greedy and SamplingParams(temperature=1e-5).greedy is False
