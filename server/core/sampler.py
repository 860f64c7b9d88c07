"""Turns the logits of the requests that finished their prompt into next tokens (and logprobs).

Greedy rows take the argmax; others apply temperature, top-k and top-p, then draw with the request's
own generator when it set a seed (reproducible whatever else is in the batch), else with the engine's.
A seeded request's draw for output i is seeded from (seed, i) alone (`draw_seed`), not from the draws
before it, so a request re-submitted with its first i outputs in the prompt draws what it would have.
Logprobs are those of the model's raw distribution (log-softmax of the logits), as in vLLM.
A row whose sampling raises fails alone: its result carries the `error` (token_id -1) and the others go on.
Legend: B = rows to sample, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.server.core.request import Request


@dataclass
class SampleResult:
    token_id: int
    logprob: float
    top_logprobs: dict[int, float] | None  # the `logprobs` most likely tokens, when asked for
    error: str | None = None  # this row's sampling failed (token_id is then -1); the engine fails the request


def _filter_top_k_top_p(logits_V: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits_V.numel():
        kth = logits_V.topk(top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    if top_p < 1.0:
        sorted_V, order_V = logits_V.sort(descending=True)
        cum_V = sorted_V.softmax(-1).cumsum(-1)
        drop_sorted_V = (cum_V - sorted_V.softmax(-1)) >= top_p  # keep the smallest set reaching top_p
        logits_V = logits_V.masked_fill(drop_sorted_V.scatter(0, order_V, drop_sorted_V), float("-inf"))
    return logits_V


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The generator seed of a seeded request's draw number `index` (0 = its first output): a 64-bit mix
    (splitmix64's finaliser) of both, so nearby (seed, index) pairs, e.g. sample j's seed + j, do not collide.
    Worked example: draw_seed(7, 0) != draw_seed(8, 0) != draw_seed(7, 1); the result is in [0, 2**64)."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _choose(row_V: torch.Tensor, req: Request, generator: torch.Generator | None) -> int:
    """One row's next token (greedy, or temperature / top-k / top-p then a draw)."""
    p = req.sampling_params
    if req.num_output_tokens < p.min_tokens and req.grammar is None:  # EOS and stop ids not allowed yet (a grammar
        # decides for itself: its end allows only EOS)
        banned = [t for t in ([] if req.eos_token_id is None else [req.eos_token_id]) + list(p.stop_token_ids or [])
                  if t < row_V.numel()]
        if banned:
            row_V = row_V.clone()
            row_V[banned] = float("-inf")
    if p.greedy:
        return int(row_V.argmax())
    row_V = _filter_top_k_top_p(row_V / p.temperature, p.top_k, p.top_p)
    gen = generator
    if req.generator is not None:
        gen = req.generator.manual_seed(draw_seed(p.seed, req.num_output_tokens))
    return int(torch.multinomial(row_V.softmax(-1), 1, generator=gen))


def _plain_greedy(req: Request) -> bool:
    """Argmax with nothing to ban: the batch's argmax answers it, without a per-row tensor op."""
    return req.sampling_params.greedy and (req.num_output_tokens >= req.sampling_params.min_tokens
                                           or req.grammar is not None)


def sample(logits_BV: torch.Tensor, requests: list[Request], generator: torch.Generator | None = None,
           masked_BV: torch.Tensor | None = None) -> list[SampleResult]:
    """masked_BV: the logits with what constrained rows may not produce at -inf (server/core/structured.py);
    tokens are chosen from it, logprobs come from the model's own distribution."""
    logits_BV = logits_BV.float()
    logprobs_BV = logits_BV.log_softmax(dim=-1)
    choose_BV = logits_BV if masked_BV is None else masked_BV.float()
    argmax_B = choose_BV.argmax(dim=-1).tolist()  # plain greedy rows: one op for the whole batch
    tokens_B: list[int] = []
    errors: dict[int, str] = {}
    for i, req in enumerate(requests):
        try:
            tokens_B.append(argmax_B[i] if _plain_greedy(req) else _choose(choose_BV[i], req, generator))
        except Exception as exc:  # noqa: BLE001 - this request fails alone
            tokens_B.append(0)
            errors[i] = f"sampling failed: {type(exc).__name__}: {exc}"
    chosen_B = logprobs_BV.gather(1, torch.tensor(tokens_B, dtype=torch.long).unsqueeze(1))[:, 0].tolist()
    results = []
    for i, req in enumerate(requests):
        if i in errors:
            results.append(SampleResult(-1, 0.0, None, error=errors[i]))
            continue
        n_top = req.sampling_params.logprobs
        top = None
        if n_top:
            values, ids = logprobs_BV[i].topk(n_top)
            top = dict(zip(ids.tolist(), values.tolist()))
        results.append(SampleResult(tokens_B[i], chosen_B[i], top))
    return results
