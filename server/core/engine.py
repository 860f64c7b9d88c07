"""The engine core: one step is schedule -> run -> update, on token ids only.

`EngineCore.step()` asks the scheduler what to compute, has the runner compute it and sample, then
records the new tokens, applies the token-level stop conditions (EOS, stop token ids, max_tokens,
max_model_len), frees what finished and reports, per request, only what is new (`EngineOutput`). Text,
stop strings and detokenization are the front end's (server/frontend/output_processor.py), which aborts
a request here when one of its stop strings matches.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch
from transformers import AutoTokenizer

from moe_serve.balancer.locality import planning_nodes
from moe_serve.balancer.placement_file import initial_placement
from moe_serve.balancer.rebalancer import Rebalancer
from moe_serve.balancer.stats import ExpertLoadRecorder
from moe_serve.experts.dispatch import DispatchStats
from moe_serve.moe.config import ModelConfig
from moe_serve.parallel import comm
from moe_serve.parallel.pipeline import stage_layer_range
from moe_serve.parallel.state import init_parallel, log_rank_table
from moe_serve.server.core.block_manager import BlockManager
from moe_serve.server.core.config import EngineConfig
from moe_serve.server.core.outputs import EngineOutput
from moe_serve.server.core.request import Request, RequestStatus
from moe_serve.server.core.runner import ModelRunner
from moe_serve.server.core.sampler import SampleResult
from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from moe_serve.server.core.startup import PhaseTimer
from moe_serve.server.core.step_trace import StepTrace, trace_path
from moe_serve.server.core.structured import StructuredOutputs

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig):
        t_start = time.perf_counter()
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        mc = self.model_config
        num_blocks = -(-config.kv_cache_tokens // config.block_size)
        # a sequence can never outgrow the KV cache, so it caps the model length too
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, num_blocks * config.block_size)
        self.dtype = config.torch_dtype(mc.torch_dtype)
        # token ids only: the tokenizer is the front end's, read here just for a config without an EOS id
        self.eos_token_id = mc.eos_token_ids[0] if mc.eos_token_ids else \
            AutoTokenizer.from_pretrained(config.model).eos_token_id
        pcfg, eplb = config.parallel_config(), config.eplb_config()
        num_slots = (mc.n_routed_experts or 0) + eplb.num_redundant_experts
        pcfg.validate_against(num_slots or pcfg.ep_size, mc.num_attention_heads, mc.num_hidden_layers,
                              mc.vocab_size)  # before any weight loads
        timer = PhaseTimer()  # seconds per start-up phase (server/core/startup.py), reported once the server is ready
        with timer.phase("parallel_init"):
            self.parallel = init_parallel(pcfg, device=None if config.device == "auto" else config.device)
            log_rank_table(self.parallel)
        self.structured = StructuredOutputs(config.model, mc.vocab_size, self.eos_token_id)
        self.runner = ModelRunner(config.model, mc, self.dtype, num_blocks, config.block_size, self.parallel,
                                  seed=config.seed, placement=self._initial_placement(num_slots), startup=timer,
                                  structured=self.structured, kernel_backend=config.kernel_backend)
        log.info("loaded %s (%s) in %.1f s", config.model, str(self.dtype).removeprefix("torch."),
                 timer.seconds["weight_load"] + timer.seconds["kv_cache"])
        self.expert_load_recorder = None
        self.rebalancer = None
        blocks = self.runner.moe_layers()
        if blocks:  # recording is on by default: one scatter-add per MoE layer, no host sync
            self.enable_expert_load_recording(eplb.window)
            self.rebalancer = Rebalancer(eplb, blocks, self.expert_load_recorder,
                                         self.parallel.ep if self.parallel.ep.size > 1 else None, mc.n_group or 1,
                                         mc.num_experts_per_tok, mc.topk_group)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, prompt_spread_s=config.prompt_spread_ms / 1e3,
            min_prompt_chunk=config.min_prompt_chunk, prompt_slowdown=config.prompt_slowdown,
            prompt_spread_max_s=config.prompt_spread_max_ms / 1e3), self.block_manager,
            shared_clock=self.parallel.cpu.size > 1)
        self._last_step_seconds = 0.0  # rank 0's, for every rank's pacing (any_rank_has_work)
        self.step_trace = None if config.step_trace is None else StepTrace(
            trace_path(config.step_trace, self.parallel.world.rank, self.parallel.world.size))
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.kv_cache_tokens_total = num_blocks * config.block_size
        timer.seconds["engine_other"] = max(0.0, time.perf_counter() - t_start - sum(timer.seconds.values()))
        self.startup_seconds = timer.seconds

    def _initial_placement(self, num_slots: int) -> dict[int, list[int]] | None:
        """This stage's expert placement at start-up (see balancer/placement_file.py); logs the memory
        that redundant slots cost."""
        mc, pcfg, config = self.model_config, self.parallel.config, self.config
        stage = stage_layer_range(mc.num_hidden_layers, pcfg.pipeline_parallel_size, self.parallel.coords.pp_rank)
        moe_layers = [i for i in range(*stage) if mc.is_moe_layer(i)]
        if not moe_layers:
            return None
        if config.num_redundant_experts:
            slot_bytes = 3 * mc.hidden_size * mc.moe_intermediate_size * self.dtype.itemsize
            log.info("%d redundant expert slots per MoE layer: %.1f MiB more per EP rank over %d layers",
                     config.num_redundant_experts,
                     config.num_redundant_experts * slot_bytes * len(moe_layers) / pcfg.ep_size / 2**20, len(moe_layers))
        return initial_placement(moe_layers, mc.n_routed_experts, num_slots, pcfg.ep_size, mc.n_group or 1,
                                 config.expert_placement, planning_nodes(self.parallel.ep.nodes),
                                 topk=mc.num_experts_per_tok, topk_group=mc.topk_group)

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    num_prior_outputs: int = 0) -> str:
        """num_prior_outputs: how many tokens at the end of the prompt this request had already produced (a
        re-submission after a lost engine job; see server/core/request.py)."""
        if not prompt_token_ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the maximum is {self.max_model_len - 1} "
                             f"(max_model_len {self.max_model_len} leaves room for at least one generated token)")
        if len(prompt_token_ids) + 1 > self.kv_cache_tokens_total:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens; the KV cache holds only {self.kv_cache_tokens_total}")
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        req = Request(request_id, list(prompt_token_ids), params, time.monotonic(), self.eos_token_id,
                      num_prior_outputs)
        if params.structured_output is not None:
            req.grammar = self.structured.matcher(params.structured_output)  # ValueError if it does not compile
            for token_id in prompt_token_ids[len(prompt_token_ids) - num_prior_outputs:]:
                req.grammar.accept(token_id)  # the outputs of an earlier job: the grammar goes on after them
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self.scheduler.abort_request(request_id) is not None:
            self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def any_rank_has_work(self) -> bool:
        """True while any rank of the job has unfinished requests (every rank must call it each step). Under a
        job it also hands every rank's scheduler rank 0's clock and last step time (Scheduler.sync_clock)."""
        if self.parallel.cpu.size == 1:
            return self.has_unfinished_requests()
        # The same all-reduce hands every rank rank 0's clock and last step time (a sum in which only rank 0's
        # terms are not zero): every rank's scheduler then paces prompts alike (scheduler.py, shared_clock).
        lead = self.parallel.rank == 0
        both = torch.tensor([float(self.has_unfinished_requests()), time.monotonic() if lead else 0.0,
                             self._last_step_seconds if lead else 0.0], dtype=torch.float64)
        both = comm.all_reduce(both, self.parallel.cpu, op=torch.distributed.ReduceOp.SUM)
        self._last_step_seconds = 0.0
        self.scheduler.sync_clock(float(both[1]), float(both[2]))
        return bool(both[0] > 0)

    # ---- the step -------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """One step: schedule -> run -> update. Returns an output for every request that got a token."""
        t_start = StepTrace.clock() if self.step_trace is not None else 0.0
        sched = self.scheduler.schedule()
        if sched.is_empty and self.parallel.world.size == 1:
            return []  # alone, an idle step does nothing; in a job it is a dummy batch for the collectives
        t0 = time.perf_counter()
        result = self.runner.execute(sched)
        self._last_step_seconds = time.perf_counter() - t0
        self.scheduler.record_step(sched, self._last_step_seconds)
        self._record_prompt_logprobs(result.prompt_logprobs)
        outputs = self._update(sched, result.sampled)
        if self.expert_load_recorder is not None:
            if sched.is_empty:  # a dummy batch (this DP rank had no work): not load
                self.expert_load_recorder.discard_step()
            else:
                self.expert_load_recorder.end_step()
            self.rebalancer.after_step()  # placement changes only here, between steps (every rank, every step)
        if self.step_trace is not None:
            self.step_trace.record(t_start, sched, len(outputs))
        return outputs

    def _record_prompt_logprobs(self, chunks: dict[str, tuple]) -> None:
        """Keep each request's prompt logprobs in position order (a chunk computed again after a preemption
        is not recorded twice); they go out with the request's first output."""
        for rid, (start, entries) in chunks.items():
            req = self.requests.get(rid)
            if req is not None and start == len(req.prompt_logprobs):
                req.prompt_logprobs.extend(entries)

    def _update(self, sched: SchedulerOutput, sampled: dict[str, SampleResult]) -> list[EngineOutput]:
        """Record the new tokens and apply stop conditions. A request whose sampling or bookkeeping
        raises fails alone (finished as aborted, its output carries the `error`); the others go on."""
        self.scheduler.update_from_output(sched, {rid: r.token_id for rid, r in sampled.items() if r.error is None})
        outputs = []
        for rid, result in sampled.items():
            req = self.requests[rid]
            try:
                if result.error is not None:
                    raise RuntimeError(result.error)
                self.num_generated_tokens += 1
                out = EngineOutput(rid, [result.token_id], self._logprobs(req, result),
                                   num_cached_tokens=req.num_cached_tokens)
                if len(req.output_token_ids) == 1 and req.sampling_params.prompt_logprobs is not None:
                    out.prompt_logprobs = req.prompt_logprobs
                if req.grammar is not None:
                    req.grammar.accept(result.token_id)
                status = self._check_stop(req, result.token_id)
                if status is not None:
                    self.scheduler.finish_request(req, status)
                    del self.requests[rid]
                    out.finish_reason, out.stop_reason = req.finish_reason, req.stop_reason
                outputs.append(out)
            except Exception as exc:  # noqa: BLE001 - this request fails alone
                log.error("request %s failed: %s", rid, exc)
                self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)  # (no-op if it had finished)
                self.requests.pop(rid, None)
                error = str(exc) if result.error is not None else f"{type(exc).__name__}: {exc}"
                outputs.append(EngineOutput(rid, [], None, "abort", None, req.num_cached_tokens, error))
        return outputs

    @staticmethod
    def _logprobs(req: Request, result: SampleResult) -> list[dict[int, float]] | None:
        """The new token's {id: logprob} (its top alternatives and itself), when the request asked for them."""
        if req.sampling_params.logprobs is None:
            return None
        top = dict(result.top_logprobs or {})
        top[result.token_id] = result.logprob
        return [top]

    def _check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        """Token-level stop conditions after `token_id` was appended (stop strings are the front end's)."""
        p = req.sampling_params
        n_out = req.num_output_tokens
        if req.grammar is not None and req.grammar.terminated:  # the grammar allows nothing more (its EOS came)
            return RequestStatus.FINISHED_STOPPED
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token_id == req.eos_token_id:
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and token_id in p.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
        if n_out >= max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def comm_stats(self) -> dict:
        """What this rank's MoE dispatch and combine sent so far (all layers), and in the last step."""
        total = sum((block.comm_stats for block in self.runner.moe_layers().values()), DispatchStats())
        return {f"dispatch_{k}": v for k, v in dataclasses.asdict(total).items()}

    def stats(self) -> dict:
        bm = self.block_manager
        return {**self.comm_stats(),
            "kv_cache_tokens_total": self.kv_cache_tokens_total,
            "kv_cache_bytes_per_token": self.model_config.num_hidden_layers * self.model_config.kv_cache_dim
            * self.dtype.itemsize,
            "kv_cache_usage": bm.usage,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_query_tokens": bm.prefix_cache_query_tokens,
            "prefix_cache_hit_tokens": bm.prefix_cache_hit_tokens,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_generated_tokens": self.num_generated_tokens,
        }

    # ---- expert load (read by the server's engine loop) -----------------------------------------
    def enable_expert_load_recording(self, window_steps: int = 1000) -> ExpertLoadRecorder:
        """Attach one ExpertLoadRecorder to every MoE block of this stage (once; later calls return it).
        The engine closes each step with `recorder.end_step()`."""
        recorder = self.expert_load_recorder
        if recorder is None:
            blocks = self.runner.moe_layers()
            layer_ids = sorted(blocks)
            phy2log_LR = torch.tensor([blocks[i].phy2log_R for i in layer_ids])
            recorder = ExpertLoadRecorder(len(layer_ids), self.model_config.n_routed_experts, window_steps=window_steps,
                                          layer_ids=layer_ids, device=self.runner.device, phy2log_LR=phy2log_LR,
                                          ep_size=self.parallel.ep.size)
            for j, layer in enumerate(layer_ids):
                blocks[layer].load_recorder = recorder.layer_sink(j)
            self.expert_load_recorder = recorder
        return recorder
