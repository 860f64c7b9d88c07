"""The offline API: `LLM(model_dir, ...).generate(prompts, SamplingParams(...))`.

The engine core in this process, and the front end's output processor for text and stop strings, as the
HTTP server uses them."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path

from transformers import AutoTokenizer

from moe_serve.parallel import comm
from moe_serve.server.core.config import EngineConfig
from moe_serve.server.core.engine import EngineCore
from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.frontend.output_processor import RequestState
from moe_serve.server.frontend.outputs import CompletionOutput, RequestOutput

log = logging.getLogger(__name__)

Prompt = str | list[int]


def _int_keys(logprobs: list[dict] | None) -> list[dict[int, float]] | None:
    """msgpack keeps int keys, but be explicit: logprob dicts are keyed by token id."""
    return None if logprobs is None else [{int(k): v for k, v in step.items()} for step in logprobs]


class LLM:
    def __init__(self, model: str, **kwargs):
        self.engine = EngineCore(EngineConfig(model=str(model), **kwargs))
        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.last_generate_seconds = 0.0
        self._num_calls = 0

    def _tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give a non-empty string or a list of token ids")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} prompts")
        tokenized = [self._tokenize(p) for p in prompts]  # validate everything before adding anything
        self._num_calls += 1  # request ids must be the same on every rank: no clocks in them
        engine = self.engine
        dp = engine.parallel.dp
        mine = [i for i in range(len(prompts)) if i % dp.size == dp.index]  # this DP rank's share
        added: list[list[str]] = []
        states: dict[str, RequestState] = {}
        try:
            for i in mine:
                (text, ids), p = tokenized[i], params_list[i]
                ids_i = []
                for j in range(p.n):  # n samples = n requests; seeds stay distinct but reproducible
                    pj = dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + j)
                    rid = engine.add_request(ids, pj, request_id=f"gen-{self._num_calls}-{i}-{j}")
                    states[rid] = RequestState(rid, text, ids, pj, self.tokenizer)
                    ids_i.append(rid)
                added.append(ids_i)
        except ValueError:
            for ids_i in added:
                for rid in ids_i:
                    engine.abort_request(rid)
            raise
        t0 = time.perf_counter()
        while engine.any_rank_has_work():
            for out in engine.step():
                if states[out.request_id].add(out):  # a stop string matched
                    engine.abort_request(out.request_id)
        self.last_generate_seconds = time.perf_counter() - t0
        results = []
        for ids_i in added:
            first = states[ids_i[0]].to_output()
            for j, rid in enumerate(ids_i[1:], 1):
                first.outputs.append(dataclasses.replace(states[rid].to_output().outputs[0], index=j))
            results.append(first)
        if dp.size == 1:
            return results
        # every rank returns every output: gather the DP ranks' shares, put them back in prompt order
        shares = comm.all_gather_object([dataclasses.asdict(r) for r in results], dp)
        ordered: list[RequestOutput | None] = [None] * len(prompts)
        for d, share in enumerate(shares):
            for k, r in enumerate(share):
                outs = [CompletionOutput(**{**c, "logprobs": _int_keys(c["logprobs"])}) for c in r.pop("outputs")]
                if r["prompt_logprobs"] is not None:
                    r["prompt_logprobs"] = [None, *_int_keys(r["prompt_logprobs"][1:])]
                ordered[d + k * dp.size] = RequestOutput(**r, outputs=outs)
        return ordered

    def stats(self) -> dict:
        return self.engine.stats()

    def expert_load(self, view: str = "window") -> dict:
        """Recorded tokens per (MoE layer, logical expert) and per physical slot, the placement and
        balancedness per layer (this rank's tokens; see balancer/stats.py)."""
        if self.engine.expert_load_recorder is None:
            raise ValueError("this model has no MoE layers on this rank")
        return self.engine.expert_load_recorder.to_json(view)

    def export_placement(self, path: str) -> None:
        """Write the current placement and the window's load as JSON (usable as `expert_placement`)."""
        Path(path).write_text(json.dumps(self.expert_load("window")))

    def rebalance(self) -> int:
        """Plan from the recorded load and move the changed experts now (every rank must call it).
        Returns how many slots loaded new weights."""
        if self.engine.rebalancer is None:
            raise ValueError("this model has no MoE layers on this rank")
        return self.engine.rebalancer.rebalance_now()
