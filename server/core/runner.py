"""Runs one scheduled step on the model: builds the flat token batch and the paged-cache metadata,
runs the forward pass, and samples for the requests whose prompt is complete. Never decides what to run.

Legend: T = tokens in the step, B = decode sequences, M = blocks per sequence, V = vocabulary.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_serve.kernels import ops
from moe_serve.kernels.select import select_backend
from moe_serve.moe.attention import AttentionMetadata, PrefillSeq, absorbed_is_cheaper
from moe_serve.moe.config import ModelConfig
from moe_serve.moe.loader import load_checkpoint
from moe_serve.moe.model import DeepseekForCausalLM
from moe_serve.parallel import comm
from moe_serve.parallel.pipeline import split_micro_batches, stage_layer_range
from moe_serve.parallel.state import ParallelState
from moe_serve.server.core.request import Request
from moe_serve.server.core.sampler import SampleResult, sample
from moe_serve.server.core.scheduler import ScheduledRequest, SchedulerOutput
from moe_serve.server.core.startup import PhaseTimer
from moe_serve.server.core.structured import StructuredOutputs

log = logging.getLogger(__name__)


DECODE_GROUP_ROWS = 16  # decode rows per attention group: fewer make the batched GEMMs too thin


def decode_group_bounds(num_rows: int, rows_per_group: int = DECODE_GROUP_ROWS) -> list[tuple[int, int]]:
    """Split num_rows (sorted by context length) into consecutive groups of rows_per_group; a short
    remainder joins the last group."""
    bounds = [(s, min(s + rows_per_group, num_rows)) for s in range(0, num_rows, rows_per_group)]
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] < rows_per_group // 2:
        bounds[-2:] = [(bounds[-2][0], num_rows)]
    return bounds


@dataclass
class PromptLogprobRows:
    """A chunk's prompt positions to score: flat rows `token_rows` predict `targets` (prompt tokens start+1...)."""
    request: Request
    start: int
    token_rows: list[int]
    targets: list[int]


@dataclass
class StepResult:
    sampled: dict[str, SampleResult]  # request id -> the token sampled for it this step
    prompt_logprobs: dict[str, tuple]  # request id -> (first position, [{token id: logprob}]) for this chunk


class ModelRunner:
    """Holds this rank's part of the model and its KV caches. Under pipeline parallelism a stage
    receives the previous stage's hidden states and sends its own on; the last stage samples and
    broadcasts the sampled tokens back to every stage, so all ranks update the same way."""

    def __init__(self, model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype, num_blocks: int, block_size: int,
                 state: ParallelState, seed: int = 0, placement: dict[int, list[int]] | None = None,
                 startup: PhaseTimer | None = None, structured: StructuredOutputs | None = None,
                 kernel_backend: str = "auto"):
        self.cfg, self.dtype, self.device, self.block_size = cfg, dtype, state.device, block_size
        # the kernel backend, once per process and before any weight exists (kernels/ops.py)
        backend = select_backend(kernel_backend, state.device, cfg.quant_block_shape)
        ops.use(backend)
        log.info("kernel backend: %s (%s)", backend.name, backend.describe())
        self.pp = state.pp
        pcfg = state.config
        layer_range = stage_layer_range(cfg.num_hidden_layers, pcfg.pipeline_parallel_size, state.coords.pp_rank)
        tp = state.tp if state.tp.size > 1 else None
        ep = state.ep if state.ep.size > 1 else None
        self.startup = startup or PhaseTimer()  # times weight_load and kv_cache
        with self.startup.phase("weight_load"):
            prev = torch.get_default_dtype()
            torch.set_default_dtype(dtype)  # weights as served; FP8 ones as stored (moe/parallel_linear.py)
            try:
                with torch.device(self.device):
                    self.model = DeepseekForCausalLM(cfg, tp, ep, layer_range, placement)
            finally:
                torch.set_default_dtype(prev)
            self.model.requires_grad_(False)
            load_checkpoint(self.model, model_dir, cfg)
            self.model.eval()
        self.decode_rows_limit = self.model.decode_rows_limit()  # prompt chunks this short go as decode rows,
        self.decode_context_limit = self.model.decode_context_limit()  # and so do those whose context ends by this
        with self.startup.phase("kv_cache"):
            # One latent cache tensor per local layer: [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]
            self.kv_caches = [torch.zeros(num_blocks, block_size, cfg.kv_cache_dim, dtype=dtype, device=self.device)
                              for _ in range(self.model.num_local_layers)]
        self.generator = torch.Generator().manual_seed(seed)
        self.structured = structured
        self._mask_worker: ThreadPoolExecutor | None = None  # fills grammar masks while the forward runs
        log.info("layers [%d, %d); KV cache: %d blocks x %d tokens, %.1f MiB", *layer_range, num_blocks, block_size,
                 sum(c.numel() * c.element_size() for c in self.kv_caches) / 2**20)

    def moe_layers(self) -> dict:
        """This rank's MoE blocks by decoder-layer index: what expert-load recording and rebalancing act on."""
        return self.model.moe_blocks()

    def _prepare(self, scheduled: list[ScheduledRequest]):
        bs = self.block_size
        token_ids, positions, slots = [], [], []
        decode_idx, decode_tables, decode_lens, prefills, sample_idx, sample_reqs = [], [], [], [], [], []
        prompt_rows: list[PromptLogprobRows] = []
        # token rows in the order of each request's context end (decode rows by context length, a prompt chunk's
        # rows side by side and in order): decode row b is then token row b where every row is one
        for item in sorted(scheduled, key=lambda it: it.request.num_computed_tokens + it.num_new_tokens):
            req, n = item.request, item.num_new_tokens
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            t0 = len(token_ids)
            last_scored = min(end, req.num_prompt_tokens - 1)  # position p scores prompt token p + 1
            if req.sampling_params.prompt_logprobs is not None and start < last_scored:
                prompt_rows.append(PromptLogprobRows(req, start, list(range(t0, t0 + last_scored - start)),
                                                     req.prompt_token_ids[start + 1:last_scored + 1]))
            num_blocks = (end + bs - 1) // bs
            if n == 1:  # a decode row (most rows of most steps): no per-token loops
                token_ids.append(req.all_token_ids[start])
                positions.append(start)
                slots.append(req.block_ids[start // bs] * bs + start % bs)
                decode_idx.append(t0)
                decode_tables.append(req.block_ids[:num_blocks])
                decode_lens.append(end)
            elif (n <= self.decode_rows_limit or end <= self.decode_context_limit
                  or absorbed_is_cheaper(n, end, self.cfg)):  # one decode row per query
                token_ids.extend(req.all_token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(req.block_ids[p // bs] * bs + p % bs for p in range(start, end))
                decode_idx.extend(range(t0, t0 + n))
                decode_tables.extend([req.block_ids[:num_blocks]] * n)
                decode_lens.extend(range(start + 1, end + 1))
            else:
                token_ids.extend(req.all_token_ids[start:end])
                positions.extend(range(start, end))
                slots.extend(req.block_ids[p // bs] * bs + p % bs for p in range(start, end))
                prefills.append(PrefillSeq(t0, n, end, torch.tensor(req.block_ids[:num_blocks], device=self.device)))
            if end == req.num_tokens:  # prompt complete: this step yields the next token
                sample_idx.append(t0 + n - 1)
                sample_reqs.append(req)
        # decode rows in groups (by context length, as laid out) that each pad only to their own longest context
        groups = [(g0, g1, max(len(t) for t in decode_tables[g0:g1]))
                  for g0, g1 in decode_group_bounds(len(decode_idx))]
        width = max((len(t) for t in decode_tables), default=1)
        tables = [t + [0] * (width - len(t)) for t in decode_tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping_T=torch.tensor(slots, dtype=torch.long, device=dev),
            decode_token_idx_B=torch.tensor(decode_idx, dtype=torch.long, device=dev),
            decode_block_tables_BM=torch.tensor(tables, dtype=torch.long, device=dev).view(len(tables), width),
            decode_context_lens_B=torch.tensor(decode_lens, dtype=torch.long, device=dev),
            prefills=prefills,
            decode_groups=groups,
        )
        inputs = (torch.tensor(token_ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev))
        return inputs, meta, sample_idx, sample_reqs, prompt_rows

    def _start_masks(self, sample_reqs: list[Request]):
        """Grammar rows of this step's sampling: (rows, the future of their bitmasks), filled off the step path."""
        rows = [i for i, req in enumerate(sample_reqs) if req.grammar is not None]
        if not rows:
            return None
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        matchers = [sample_reqs[i].grammar for i in rows]
        return rows, self._mask_worker.submit(self.structured.fill, rows, matchers, len(sample_reqs))

    def _masked(self, logits_BV: torch.Tensor, masks) -> torch.Tensor | None:
        if masks is None:
            return None
        rows, future = masks
        bitmask, bans = future.result()
        masked_BV = logits_BV.float().clone()
        self.structured.apply(masked_BV, rows, bitmask, bans)
        return masked_BV

    def _prompt_logprobs(self, hidden_TH: torch.Tensor, rows: list[PromptLogprobRows]) -> dict[str, tuple]:
        """Per request: (first position scored, [{next prompt token: logprob, top alternatives...}])."""
        flat = [t for r in rows for t in r.token_rows]
        logprobs_PV = self.model.compute_logits(hidden_TH[torch.tensor(flat, device=self.device)]).float()
        logprobs_PV = logprobs_PV.log_softmax(-1).cpu()
        out, at = {}, 0
        for r in rows:
            lp_PV = logprobs_PV[at:at + len(r.targets)]
            at += len(r.targets)
            chosen = lp_PV.gather(1, torch.tensor(r.targets).unsqueeze(1))[:, 0].tolist()
            top_k = r.request.sampling_params.prompt_logprobs
            tops = lp_PV.topk(top_k) if top_k else None
            entries = []
            for i, (target, value) in enumerate(zip(r.targets, chosen)):
                entry = dict(zip(tops.indices[i].tolist(), tops.values[i].tolist())) if tops is not None else {}
                entry[target] = value
                entries.append(entry)
            out[r.request.request_id] = (r.start, entries)
        return out

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Runs the step (an empty one is a dummy batch that still takes part in every collective), its ops on the
        threads the kernel backend chooses for a step (kernels/ops.py step_threads)."""
        with ops.step_threads():
            return self._execute(sched)

    def _execute(self, sched: SchedulerOutput) -> StepResult:
        """The step's micro-batches through the model, and their samples.

        Under pipeline parallelism the step is cut into as many micro-batches as there are stages:
        a stage sends micro-batch m on without waiting and computes m + 1 while the next stage
        computes m, so stages work at the same time instead of in turn.
        """
        pp, first, last = self.pp, self.model.model.is_first, self.model.model.is_last
        parts = split_micro_batches(sched.scheduled, [s.num_new_tokens for s in sched.scheduled], pp.size)
        results: dict[str, SampleResult] = {}
        prompt_lps: dict[str, tuple] = {}
        pending_sends = []
        for part in parts:
            (input_ids_T, positions_T), meta, sample_idx, sample_reqs, prompt_rows = self._prepare(part)
            masks = self._start_masks(sample_reqs) if last else None
            hidden_in = None if first else comm.recv_tensor(pp.index - 1, pp)
            hidden_TH = self.model(input_ids_T, positions_T, self.kv_caches, meta, hidden_in)
            if not last:
                pending_sends.append(comm.isend_tensor(hidden_TH, pp.index + 1, pp))
                continue
            if sample_reqs:
                logits_BV = self.model.compute_logits(hidden_TH[torch.tensor(sample_idx, device=self.device)]).cpu()
                samples = sample(logits_BV, sample_reqs, self.generator, self._masked(logits_BV, masks))
                results.update({req.request_id: r for req, r in zip(sample_reqs, samples)})
            if prompt_rows:
                prompt_lps.update(self._prompt_logprobs(hidden_TH, prompt_rows))
        for wait in pending_sends:
            wait()
        if pp.size > 1:
            wire = ({rid: [r.token_id, r.logprob, r.top_logprobs, r.error] for rid, r in results.items()}, prompt_lps) \
                if last else None
            wire, prompt_lps = comm.broadcast_object(wire, pp, src=pp.size - 1)
            results = {rid: SampleResult(t, lp, {int(k): v for k, v in top.items()} if top else top, err)
                       for rid, (t, lp, top, err) in wire.items()}
            prompt_lps = {rid: (start, [{int(k): v for k, v in e.items()} for e in entries])
                          for rid, (start, entries) in prompt_lps.items()}
        return StepResult(results, prompt_lps)
