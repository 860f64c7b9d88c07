"""Which requests run this step, and how many of their tokens. CPU only; never touches tensors.

The engine step reads: `out = scheduler.schedule()`, run the model on `out.scheduled`, sample for the
requests whose tokens are all computed, `scheduler.update_from_output(out, sampled)`, check stop
conditions and `scheduler.finish_request(...)` the finished ones.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from moe_serve.server.core.block_manager import BlockManager
from moe_serve.server.core.pacing import (BURST, OVERLOAD, RunningMean, StepCost, StepTimer, prompt_tokens_per_step,
                                          prompt_tokens_within)
from moe_serve.server.core.request import Request, RequestStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64                 # most requests in `running` at once
    max_num_batched_tokens: int = 2048     # token budget per step
    max_model_len: int = 4096              # longest prompt + output (enforced by the engine)
    long_prefill_token_threshold: int = 0  # 0 = none; else the most tokens one request computes a step
    # While decodes run, a new prompt is spread over steps for up to this long (pacing.py): every step
    # carries the same thin slice instead of one step a long chunk that stalls the running streams.
    # 0 = each step takes as many prompt tokens as the token budget allows.
    prompt_spread_s: float = 0.0
    min_prompt_chunk: int = 16  # spread or not, a step with prompts pending gives them at least this many tokens
    # With prompt_spread_s: while decodes run, pending prompts get as many tokens a step as keep the step within
    # this many times what its decodes alone take (by the fitted step cost, pacing.py); more only where a
    # prompt would otherwise miss arrival + prompt_spread_s. 0 = off: the due-time rate alone.
    prompt_slowdown: float = 0.0
    # With prompt_spread_s: the latest a prompt may be done by (arrival + this) when arrivals bunch up; until
    # then a step carries at most pacing.BURST x the prompt tokens steps have carried lately. 0 = off: every
    # prompt by arrival + prompt_spread_s.
    prompt_spread_max_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be 0 (no cap) or a positive integer, "
                             f"got {self.long_prefill_token_threshold!r}")
        if not isinstance(self.prompt_spread_s, (int, float)) or not 0 <= self.prompt_spread_s < 3600:
            raise ValueError(f"prompt_spread_s must be 0 (off) or a number of seconds, got {self.prompt_spread_s!r}")
        if not isinstance(self.min_prompt_chunk, int) or self.min_prompt_chunk < 1:
            raise ValueError(f"min_prompt_chunk must be a positive integer, got {self.min_prompt_chunk!r}")
        check_prompt_slowdown(self.prompt_slowdown)
        check_prompt_spread_max(self.prompt_spread_max_s, self.prompt_spread_s, "s")


def check_prompt_spread_max(value, spread, unit: str) -> None:
    """prompt_spread_max (in `unit`, "s" or "ms"): 0 (off), or above a spread that is on, up to a minute."""
    if value == 0:
        return
    if not isinstance(value, (int, float)) or not spread or not spread < value <= (60 if unit == "s" else 60_000):
        raise ValueError(f"prompt_spread_max_{unit} must be 0 (off) or more than prompt_spread_{unit} (which must be "
                         f"on, now {spread!r}) and at most a minute, got {value!r}")


def check_prompt_slowdown(value) -> None:
    if not isinstance(value, (int, float)) or not (value == 0 or 1 < value <= 10):
        raise ValueError(f"prompt_slowdown must be 0 (off) or a factor above 1 and at most 10, got {value!r}")


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int   # tokens to compute this step, starting at request.num_computed_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # running first, then admitted
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def shape(self) -> tuple[int, int]:
        """(decodes, prompt tokens): requests computing one token, and the tokens of prompt chunks."""
        return (sum(1 for s in self.scheduled if s.num_new_tokens == 1),
                sum(s.num_new_tokens for s in self.scheduled if s.num_new_tokens > 1))


class Scheduler:
    """`shared_clock`: under a multi-rank job every rank runs its own scheduler and all must decide alike, so
    the pacing must not read this process's clock or step times: the engine hands each rank rank 0's
    (`sync_clock`, once per step), and a request's arrival time is the first such clock after it was added."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, clock=time.monotonic,
                 shared_clock: bool = False) -> None:
        self.config = config
        self.clock = clock                 # the clock of Request.arrival_time (alone)
        self.step_timer = StepTimer()      # recent step time, fed by the engine (record_step)
        self.step_cost = StepCost()        # a step's time against its decodes and prompt tokens (record_step)
        self.prompt_mean = RunningMean(0.98)  # prompt tokens per step beside decodes, lately (record_step)
        self._stretch_s: dict[str, float] = {}  # request id -> seconds its latest due time adds (_latest_rate)
        self.shared_clock = shared_clock
        self._shared_now: float | None = None   # rank 0's clock at the last sync_clock
        self._last_shape: tuple[int, ...] | None = None   # the last step's shape (record_step), shared
        self._unstamped: list[Request] = []     # added since the last sync_clock (shared)
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}   # unfinished requests by id
        self.num_preemptions = 0

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use; ids must be unique")
        request.status = RequestStatus.WAITING
        if self.shared_clock:
            self._unstamped.append(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish an unfinished request as aborted; None if the id is unknown or already finished."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _chunk(self, request: Request, budget: int, prompt_budget: int) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if num_new > 1:   # a prompt chunk (a decode is never held back)
            num_new = min(num_new, prompt_budget)
            if self.config.long_prefill_token_threshold > 0:
                num_new = min(num_new, self.config.long_prefill_token_threshold)
        return num_new

    def _prompt_budget(self) -> int:
        """Prompt tokens this step may carry beside its decodes (pacing.py); the token budget bounds them too."""
        cfg = self.config
        left = [r.num_tokens - r.num_computed_tokens for r in self.running]
        if cfg.prompt_spread_s == 0 or self.step_timer.seconds is None or 1 not in left:
            return cfg.max_num_batched_tokens  # nothing to pace, or no running stream to protect
        now = self.now()
        room = cfg.max_num_seqs - len(self.running)
        prompts = [(r, n) for r, n in zip(self.running, left) if n > 1]
        prompts += [(r, r.num_tokens - r.num_computed_tokens) for r in list(self.waiting)[:room]]
        pending = [(n, r.arrival_time + cfg.prompt_spread_s - now) for r, n in prompts]
        rate = prompt_tokens_per_step(pending, self.step_timer.seconds)
        if cfg.prompt_spread_max_s and self.prompt_mean.value is not None:  # a bunch of arrivals may stretch
            cap = int(BURST * self.prompt_mean.value)
            rate = max(self._latest_rate(prompts, pending, cap), min(rate, cap))
        if cfg.prompt_slowdown and (coef := self.step_cost.fit()) is not None:
            within = prompt_tokens_within(coef, left.count(1), cfg.prompt_slowdown)
            rate = max(rate, within if within is not None else 0)
        return max(cfg.min_prompt_chunk, rate)

    def _latest_rate(self, prompts: list[tuple[Request, int]], pending: list[tuple[int, float]], cap: int) -> int:
        """The prompt tokens a step that meet every prompt's latest due time. A prompt's latest due time is fixed
        when first seen: arrival + prompt_spread_max_s, unless even by that it and the prompts before it would need
        more than OVERLOAD x the cap a step (not a passing bunch but overload, where stretching only delays);
        then arrival + prompt_spread_s."""
        later, step_s = self.config.prompt_spread_max_s - self.config.prompt_spread_s, self.step_timer.seconds
        for i, (request, n) in enumerate(prompts):
            if request.request_id not in self._stretch_s:
                trial = [(m, s + self._stretch_s[r.request_id]) for (r, m), (_, s) in zip(prompts[:i], pending[:i])]
                trial.append((n, pending[i][1] + later))
                fits = prompt_tokens_per_step(trial, step_s) <= OVERLOAD * cap
                self._stretch_s[request.request_id] = later if fits else 0.0
        latest = [(n, s + self._stretch_s[r.request_id]) for (r, n), (_, s) in zip(prompts, pending)]
        return prompt_tokens_per_step(latest, step_s)

    def now(self) -> float:
        """The pacing's clock: this process's, or rank 0's at the last sync_clock (shared_clock)."""
        if self.shared_clock:
            return self._shared_now if self._shared_now is not None else 0.0
        return self.clock()

    def record_step(self, scheduler_output: SchedulerOutput, seconds: float) -> None:
        """The engine ran `scheduler_output` in `seconds` (what the pacing paces by). With a shared clock the
        step's shape waits for rank 0's time of it (sync_clock)."""
        if scheduler_output.is_empty:
            return
        shape = ()  # (decodes, prompt tokens): for the step-cost fit (prompt_slowdown) and the prompt mean (max spread)
        if self.config.prompt_slowdown or self.config.prompt_spread_max_s:
            shape = scheduler_output.shape
        if self.shared_clock:
            self._last_shape = shape
        else:
            self._observe(shape, seconds)

    def sync_clock(self, now: float, last_step_seconds: float) -> None:
        """shared_clock: rank 0's clock now and how long its last step took (0 for none), the same on every rank."""
        self._shared_now = now
        if last_step_seconds > 0 and self._last_shape is not None:
            self._observe(self._last_shape, last_step_seconds)
        self._last_shape = None
        for request in self._unstamped:
            request.arrival_time = now
        self._unstamped.clear()

    def _observe(self, shape: tuple[int, ...], seconds: float) -> None:
        self.step_timer.observe(seconds)
        if shape:
            self.step_cost.observe(*shape, seconds)
            if shape[0]:  # a step beside running decodes: what the pacing's cap follows
                self.prompt_mean.observe(shape[1])

    def _check_fits(self, request: Request, num_tokens: int) -> None:
        bm = self.block_manager
        if bm.num_blocks_for(num_tokens) > bm.num_blocks:
            raise RuntimeError(
                f"request {request.request_id!r} needs {bm.num_blocks_for(num_tokens)} KV blocks for "
                f"{num_tokens} tokens but the cache has only {bm.num_blocks} blocks of "
                f"{bm.block_size}; lower max_model_len or give the KV cache more memory")

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        # Invariant: there are no prefill or decode phases. Every request has num_computed_tokens
        # catching up with num_tokens; each step gives each request a chunk of
        # num_tokens - num_computed_tokens (a decode is a chunk of 1) under one token budget, and every
        # scheduled request holds blocks for num_computed_tokens + its chunk. Running requests go first,
        # in order; if blocks run out, the newest running request is preempted (recompute). Waiting
        # requests are admitted FIFO only in a step without preemption.
        #
        # Worked example, budget 8, block_size 4: running = [A (decode, 1 token left),
        # B (prompt 20, 4 computed)], waiting = [C (prompt 6)]:
        #   A: 1 token (budget 7), B: 7 tokens (budget 0), C: not admitted (no budget this step).
        #
        # With prompt_spread_s, prompt chunks also share `prompt_budget` while decodes run: the same thin
        # slice every step that finishes each prompt by arrival + spread (pacing.py). Decodes are never
        # held back; a prompt that gets no tokens this step keeps its place.
        budget = self.config.max_num_batched_tokens
        prompt_budget = self._prompt_budget()
        out = SchedulerOutput()

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request, budget, prompt_budget)
            if num_new == 0:
                i += 1
                continue
            self._check_fits(request, request.num_computed_tokens + num_new)
            while not self.block_manager.allocate_slots(request, num_new):
                victim = self.running.pop()   # newest; index >= i, so never already scheduled
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                if num_new > 1:
                    prompt_budget -= num_new
                i += 1
                continue
            break   # `request` preempted itself: it was the last running request

        while (not out.preempted and self.waiting and budget > 0 and prompt_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            self._check_fits(request, request.num_tokens)
            first_time = request.status == RequestStatus.WAITING
            # prompt logprobs need every prompt position computed: no prefix-cache hits for them
            wants_all = request.sampling_params.prompt_logprobs is not None
            num_hit = 0 if wants_all else self.block_manager.get_computed_blocks(request)
            request.num_computed_tokens = num_hit
            if first_time:
                request.num_cached_tokens = num_hit
            num_new = self._chunk(request, budget, prompt_budget)
            if not self.block_manager.allocate_slots(request, num_new):
                self.block_manager.free(request)   # give back the prefix blocks it took
                request.num_computed_tokens = 0
                if not self.running:
                    bm = self.block_manager
                    raise RuntimeError(
                        f"cannot admit request {request.request_id!r} ({request.num_tokens} tokens) with "
                        f"no request running: {bm.num_free_blocks} of {bm.num_blocks} blocks free; "
                        "some finished request was not freed")
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
            prompt_budget -= num_new

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[str, int]) -> None:
        """Record that the scheduled chunks were computed, cache the blocks that became full, and
        append the sampled tokens. Stop conditions are the engine's job (then `finish_request`)."""
        for s in scheduler_output.scheduled:
            request = s.request
            if request.is_finished():   # aborted between schedule() and now
                continue
            request.num_computed_tokens += s.num_new_tokens
            self.block_manager.cache_blocks(request, request.num_computed_tokens)
            token_id = sampled.get(request.request_id)
            if token_id is not None:
                if request.num_computed_tokens != request.num_tokens:
                    raise ValueError(
                        f"sampled a token for {request.request_id!r} with only "
                        f"{request.num_computed_tokens} of {request.num_tokens} tokens computed; "
                        "sample only for requests whose chunk reaches the end of their tokens")
                request.append_output_token(token_id)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Free the request's blocks and drop it from the queues (running or waiting)."""
        if not RequestStatus.is_finished(status):
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status.name}")
        if request.is_finished():
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.requests.pop(request.request_id, None)
        self._stretch_s.pop(request.request_id, None)
        self.block_manager.free(request)
        request.status = status
        request.finish_reason = status.finish_reason
