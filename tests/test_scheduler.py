import random

import pytest

from moe_serve.server.core.block_manager import BlockManager
from moe_serve.server.core.request import Request, RequestStatus
from moe_serve.server.core.sampling_params import SamplingParams
from moe_serve.server.core.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=64, block_size=4, **config):
    return Scheduler(SchedulerConfig(**config), BlockManager(num_blocks, block_size))


def add(sched, rid, tokens):
    r = Request(rid, list(tokens), SamplingParams())
    sched.add_request(r)
    return r


def step(sched, finish_at=None):
    """A fake engine step: sample token 1 for every request whose chunk completes its tokens, and
    finish a request once it has `finish_at` outputs."""
    out = sched.schedule()
    sampled = {s.request.request_id: 1 for s in out.scheduled
               if s.request.num_computed_tokens + s.num_new_tokens == s.request.num_tokens}
    sched.update_from_output(out, sampled)
    for s in out.scheduled:
        if finish_at is not None and s.request.num_output_tokens >= finish_at:
            sched.finish_request(s.request, RequestStatus.FINISHED_LENGTH)
    return out


def chunks(out):
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs must be a positive integer, got 0"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive integer, got -1"):
        SchedulerConfig(max_num_batched_tokens=-1)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be 0"):
        SchedulerConfig(long_prefill_token_threshold=-4)


def test_budget_mixes_decodes_and_chunked_prefills():
    # The worked example in schedule(): budget 8, A decodes while B's 20-token prompt is chunked.
    s = make(max_num_batched_tokens=8)
    add(s, "A", range(3))
    out = step(s)
    assert chunks(out) == [("A", 3)] and out.num_batched_tokens == 3   # nothing else waiting yet
    add(s, "B", range(100, 120))
    add(s, "C", range(200, 206))
    out = step(s)
    assert chunks(out) == [("A", 1), ("B", 7)] and out.num_batched_tokens == 8
    out = step(s)   # running first: A decodes, B continues its prompt; no budget left for C
    assert chunks(out) == [("A", 1), ("B", 7)]
    out = step(s)   # B's last 6 prompt tokens leave 1 token of budget: C gets a 1-token chunk
    assert chunks(out) == [("A", 1), ("B", 6), ("C", 1)]
    assert s.running[1].num_output_tokens == 1 and s.running[2].num_computed_tokens == 1
    out = step(s)
    assert chunks(out) == [("A", 1), ("B", 1), ("C", 5)]
    assert all(r.num_tokens - r.num_computed_tokens == 1 for r in s.running)   # all decoding now


def test_long_prompt_chunks_catch_up():
    s = make(max_num_batched_tokens=4)
    r = add(s, "r", range(10))
    progress = []
    for _ in range(4):
        step(s)
        progress.append((r.num_computed_tokens, r.num_tokens))
    # 4 + 4 + 2 prompt tokens, the third chunk completes the prompt and samples; then decodes.
    assert progress == [(4, 10), (8, 10), (10, 11), (11, 12)]
    assert len(r.block_ids) == 3   # 12 tokens in blocks of 4 once the 12th is scheduled


def test_long_prefill_threshold_caps_each_request():
    s = make(max_num_batched_tokens=100, long_prefill_token_threshold=3)
    add(s, "a", range(7))
    add(s, "b", range(50, 52))
    assert chunks(step(s)) == [("a", 3), ("b", 2)]
    assert chunks(step(s)) == [("a", 3), ("b", 1)]


def test_max_num_seqs_and_fifo():
    s = make(max_num_seqs=2)
    for i in range(4):
        add(s, f"r{i}", range(10 * i, 10 * i + 3))
    out = step(s)
    assert chunks(out) == [("r0", 3), ("r1", 3)] and [r.request_id for r in s.waiting] == ["r2", "r3"]
    finished = []
    while s.has_unfinished():
        for sr in step(s, finish_at=2).scheduled:
            if sr.request.is_finished():
                finished.append(sr.request.request_id)
        assert len(s.running) <= 2
    assert finished == ["r0", "r1", "r2", "r3"]


def test_prefix_cache_hit_skips_computed_prompt():
    s = make(block_size=4)
    add(s, "a", range(10))
    step(s)
    b = add(s, "b", list(range(8)) + [77, 78, 79])
    out = step(s)
    assert chunks(out) == [("a", 1), ("b", 3)]
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == s.running[0].block_ids[:2]


def test_preempts_newest_and_recomputes_to_completion():
    # 4 blocks of 2 tokens; two 3-token prompts each grow to 7 tokens (4 blocks): they cannot both fit.
    s = make(num_blocks=4, block_size=2)
    a, b = add(s, "a", [10, 11, 12]), add(s, "b", [20, 21, 22])
    assert chunks(step(s, finish_at=4)) == [("a", 3), ("b", 3)]   # 2 blocks each, cache full
    assert chunks(step(s, finish_at=4)) == [("a", 1), ("b", 1)]   # 4 tokens still fit in 2 blocks
    out = step(s, finish_at=4)                                      # a needs a 3rd block: evict b
    assert chunks(out) == [("a", 1)] and out.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert list(s.waiting) == [b] and s.num_preemptions == 1
    while s.has_unfinished():
        out = step(s, finish_at=4)
        assert not out.is_empty
    assert a.output_token_ids == [1] * 4 and b.output_token_ids == [1] * 4
    assert a.finish_reason == b.finish_reason == "length"
    assert s.block_manager.num_free_blocks == 4 and s.num_preemptions == 1
    assert b.num_cached_tokens == 0   # set on first admission only, not on resume


def test_request_that_needs_a_block_preempts_itself():
    s = make(num_blocks=4, block_size=2)
    a, b = add(s, "a", [1, 2, 3]), add(s, "b", [5, 6, 7, 8])
    step(s)                                  # a: 4 tokens in 2 blocks; b: 5 tokens, needs a 3rd
    out = step(s)
    assert chunks(out) == [("a", 1)] and out.preempted == [b] and s.running == [a]


def test_abort_frees_blocks_and_dequeues():
    s = make(num_blocks=8, block_size=4, max_num_seqs=1)
    a, b = add(s, "a", range(6)), add(s, "b", range(6))
    step(s)
    assert s.block_manager.num_free_blocks == 6
    assert s.abort_request("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.block_ids == [] and s.block_manager.num_free_blocks == 8 and s.running == []
    assert s.abort_request("b") is b and not s.waiting and not s.has_unfinished()
    assert s.abort_request("a") is None and s.abort_request("nope") is None


def test_abort_between_schedule_and_update_is_skipped():
    s = make()
    a = add(s, "a", range(5))
    out = s.schedule()
    s.abort_request("a")
    s.update_from_output(out, {"a": 1})
    assert a.num_output_tokens == 0 and s.block_manager.num_free_blocks == 64


def test_sampling_an_incomplete_prompt_is_an_error():
    s = make(max_num_batched_tokens=2)
    add(s, "a", range(5))
    with pytest.raises(ValueError, match="only 2 of 5 tokens computed"):
        s.update_from_output(s.schedule(), {"a": 1})


def test_request_that_can_never_fit_raises():
    s = make(num_blocks=2, block_size=2)
    add(s, "big", range(5))
    with pytest.raises(RuntimeError, match="needs 3 KV blocks for 5 tokens but the cache has only 2"):
        s.schedule()


def test_duplicate_request_id_rejected():
    s = make()
    add(s, "a", [1])
    with pytest.raises(ValueError, match="already in use"):
        add(s, "a", [2])


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_invariants(seed):
    rng = random.Random(seed)
    cfg = dict(max_num_seqs=6, max_num_batched_tokens=16, long_prefill_token_threshold=rng.choice([0, 5]))
    s = make(num_blocks=24, block_size=4, **cfg)
    prefixes = [[rng.randrange(50) for _ in range(8)] for _ in range(3)]
    reqs = [add(s, f"r{i}", rng.choice(prefixes)[:rng.randrange(1, 9)] + [rng.randrange(50)
                                                                           for _ in range(rng.randrange(20))])
            for i in range(20)]
    for _ in range(2000):
        if not s.has_unfinished():
            break
        out = step(s, finish_at=5)
        assert out.num_batched_tokens == sum(x.num_new_tokens for x in out.scheduled) <= 16
        assert len(s.running) <= 6
        for r in s.running:
            assert len(r.block_ids) * 4 >= r.num_computed_tokens
    assert not s.has_unfinished()
    assert all(r.output_token_ids == [1] * 5 and r.num_computed_tokens == r.num_tokens - 1 for r in reqs)
    bm = s.block_manager
    assert bm.num_free_blocks == 24 and sum(bm.ref_counts) == 0 and bm.prefix_cache_hit_tokens > 0


def test_prompt_tokens_per_step_meets_every_due_time():
    from moe_serve.server.core.pacing import prompt_tokens_per_step

    assert prompt_tokens_per_step([], 0.01) == 0
    assert prompt_tokens_per_step([(128, 0.3)], 0.01) == 5        # 30 steps left: ceil(128 / 30)
    # the second prompt is due sooner relative to what both need: 60 + 100 tokens in 10 steps
    assert prompt_tokens_per_step([(60, 0.3), (100, 0.1)], 0.01) == 16
    assert prompt_tokens_per_step([(40, -2.0)], 0.01) == 40      # overdue: all of it now
    with pytest.raises(ValueError, match="step_seconds"):
        prompt_tokens_per_step([(1, 1.0)], 0.0)


def test_prompt_spread_paces_chunks_beside_running_decodes():
    now = [0.0]
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=256, prompt_spread_s=1.0, min_prompt_chunk=4),
                      BlockManager(128, 4), clock=lambda: now[0])
    a = Request("a", [3] * 5, SamplingParams(), arrival_time=0.0)
    sched.add_request(a)
    step(sched)                       # no decode running: the whole prompt at once, nothing paced
    sched.step_timer.observe(0.1)     # steps take 0.1 s: a prompt due in 1 s has 10 steps
    b = Request("b", [4] * 100, SamplingParams(), arrival_time=0.0)
    sched.add_request(b)
    out = step(sched)
    assert chunks(out) == [("a", 1), ("b", 10)]   # 100 tokens over 10 steps beside the running decode
    now[0] = 0.5                      # 90 left, due in 0.5 s = 5 steps: 18 a step
    assert chunks(step(sched)) == [("a", 1), ("b", 18)]
    now[0] = 0.99                     # due within this step: the rest at once
    assert chunks(step(sched)) == [("a", 1), ("b", 72)]
    sched_off = make(max_num_batched_tokens=256)   # prompt_spread_s 0: the token budget only
    add(sched_off, "a", [3] * 5)
    step(sched_off)
    sched_off.step_timer.observe(0.1)
    add(sched_off, "b", [4] * 100)
    assert chunks(step(sched_off)) == [("a", 1), ("b", 100)]


def test_prompt_spread_config_validation():
    with pytest.raises(ValueError, match="prompt_spread_s"):
        SchedulerConfig(prompt_spread_s=-1)
    with pytest.raises(ValueError, match="min_prompt_chunk"):
        SchedulerConfig(min_prompt_chunk=0)
    from moe_serve.server.cli import _engine_kwargs, build_parser
    from moe_serve.server.core.config import EngineConfig

    with pytest.raises(ValueError, match="min_prompt_chunk must be a positive integer, got 0"):
        EngineConfig(model="m", min_prompt_chunk=0)
    args = build_parser().parse_args(["serve", "m", "--prompt-spread-ms", "300", "--min-prompt-chunk", "4"])
    kw = _engine_kwargs(args)
    assert kw["prompt_spread_ms"] == 300 and kw["min_prompt_chunk"] == 4


def test_step_cost_fits_a_steps_time_to_its_decodes_and_prompt_tokens():
    from moe_serve.server.core.pacing import StepCost, prompt_tokens_within

    rng = random.Random(0)
    cost = StepCost()
    for _ in range(7):
        cost.observe(10, 20, 0.01)
    assert cost.fit() is None                     # fewer than 8 steps
    same_prompt = StepCost()
    for _ in range(50):
        same_prompt.observe(rng.randint(1, 30), 16, 0.01)
    assert same_prompt.fit() is None              # prompt tokens never vary: their cost is unknown
    for _ in range(300):
        d, p = rng.randint(1, 30), rng.choice([0, 4, 16, 40, 100])
        cost.observe(d, p, 0.008 + 0.0003 * d + 0.00015 * p)
    a, b, c = cost.fit()
    assert a == pytest.approx(0.008, rel=1e-3) and b == pytest.approx(0.0003, rel=1e-2)
    assert c == pytest.approx(0.00015, rel=1e-3)
    # 13 decodes alone: 11.9 ms; 30% of that is 3.57 ms of prompt tokens at 0.15 ms each: 23
    assert prompt_tokens_within((0.008, 0.0003, 0.00015), 13, 1.3) == 23
    assert prompt_tokens_within((0.008, 0.0003, 0.00015), 13, 1.0) == 0
    assert prompt_tokens_within((-0.05, 0.0003, 0.00015), 13, 1.3) is None    # a fit that says nothing
    flat = StepCost()
    for _ in range(100):
        d, p = rng.randint(1, 30), rng.choice([0, 50])
        flat.observe(d, p, 0.01 + 0.0003 * d - 0.00001 * p)
    assert flat.fit() is None                     # prompt tokens "saving" time: no cap from that


def paced_with_one_decode(now: list[float], blocks: int, **config) -> Scheduler:
    """A scheduler pacing prompts over 1 s (clock: now[0]) with request "a" decoding and steps of 0.1 s."""
    sched = Scheduler(SchedulerConfig(prompt_spread_s=1.0, min_prompt_chunk=4, **config), BlockManager(blocks, 4),
                      clock=lambda: now[0])
    sched.add_request(Request("a", [3] * 5, SamplingParams(), arrival_time=0.0))
    step(sched)
    sched.step_timer.observe(0.1)
    return sched


def test_prompt_slowdown_gives_waiting_prompts_what_keeps_the_step_within_it():
    now = [0.0]                                   # 10 steps to the due time: 10 tokens a step would do
    sched = paced_with_one_decode(now, 128, max_num_batched_tokens=256, prompt_slowdown=1.5)
    for p in (0, 8, 32) * 4:                      # a step: 20 ms + 0.2 ms per prompt token (one decode)
        sched.step_cost.observe(1, p, 0.02 + 0.0002 * p)
    b = Request("b", [4] * 150, SamplingParams(), arrival_time=0.0)
    sched.add_request(b)
    # half of the decode's 20 ms is 50 prompt tokens: more than the due time needs (15), so b is done sooner
    assert chunks(step(sched)) == [("a", 1), ("b", 50)]
    now[0] = 0.95                                 # 100 left and due within this step: the due time wins
    assert chunks(step(sched)) == [("a", 1), ("b", 100)]
    c = Request("c", [5] * 200, SamplingParams(), arrival_time=0.95)
    sched.add_request(c)
    assert chunks(step(sched)) == [("a", 1), ("b", 1), ("c", 50)]
    with pytest.raises(ValueError, match="prompt_slowdown must be 0"):
        SchedulerConfig(prompt_slowdown=0.5)
    from moe_serve.server.cli import _engine_kwargs, build_parser
    from moe_serve.server.core.config import EngineConfig

    with pytest.raises(ValueError, match="needs prompt_spread_ms > 0"):
        EngineConfig(model="m", prompt_slowdown=1.3)
    args = build_parser().parse_args(["serve", "m", "--prompt-spread-ms", "300", "--prompt-slowdown", "1.3"])
    assert _engine_kwargs(args)["prompt_slowdown"] == 1.3


def test_a_latest_due_time_lets_a_bunch_of_prompts_stretch_at_a_capped_rate():
    now = [0.0]                                   # 10 steps to the due time, 20 to the latest
    sched = paced_with_one_decode(now, 256, max_num_batched_tokens=512, prompt_spread_max_s=2.0)
    sched.prompt_mean.observe(10)                 # steps have carried 10 prompt tokens: the cap is 1.2 x 10 = 12
    b = Request("b", [4] * 300, SamplingParams(), arrival_time=0.0)
    sched.add_request(b)
    # by its due time b needs 30 a step, more than the cap; by the latest 15, which the cap does not go below
    assert chunks(step(sched)) == [("a", 1), ("b", 15)]
    now[0] = 1.5                                  # past its due time, 0.5 s (5 steps) to the latest: 285 / 5
    assert chunks(step(sched)) == [("a", 1), ("b", 57)]
    now[0] = 1.6
    sched.prompt_mean.value = 300.0               # a cap (360) above the due time's rate (all 228 left): that rate
    assert chunks(step(sched)) == [("a", 1), ("b", 228)]
    # a queue longer than a bunch: c would need 45 a step (more than 2 x the cap of 12) even by the latest due
    # times, so it keeps its first due time as its latest, and b before it must go at c's pace
    sched = paced_with_one_decode(now := [0.0], 256, max_num_batched_tokens=512, prompt_spread_max_s=2.0)
    sched.prompt_mean.observe(10)
    for rid, n in (("b", 300), ("c", 600)):
        sched.add_request(Request(rid, [4] * n, SamplingParams(), arrival_time=0.0))
    assert chunks(step(sched)) == [("a", 1), ("b", 90)]   # 900 tokens by c's due time, 10 steps away
    assert sched._stretch_s == {"b": 1.0, "c": 0.0}
    with pytest.raises(ValueError, match="prompt_spread_max_s must be 0 .off. or more than prompt_spread_s"):
        SchedulerConfig(prompt_spread_s=0.3, prompt_spread_max_s=0.2)
    from moe_serve.server.cli import _engine_kwargs, build_parser
    from moe_serve.server.core.config import EngineConfig

    with pytest.raises(ValueError, match="which must be on"):
        EngineConfig(model="m", prompt_spread_max_ms=400)
    args = build_parser().parse_args(["serve", "m", "--prompt-spread-ms", "300", "--prompt-spread-max-ms", "450"])
    assert _engine_kwargs(args)["prompt_spread_max_ms"] == 450


def test_shared_clock_paces_by_rank_0s_time_only():
    """Ranks of one job each run a scheduler; with a shared clock they read only what sync_clock hands them
    (rank 0's clock and step times), so schedulers whose own clocks disagree still decide alike."""
    def make_rank(offset):
        return Scheduler(SchedulerConfig(max_num_batched_tokens=64, prompt_spread_s=0.5, min_prompt_chunk=2,
                                         prompt_slowdown=1.2, prompt_spread_max_s=0.8), BlockManager(256, 4),
                         clock=lambda: 1000.0 * offset, shared_clock=True)

    ranks = [make_rank(0), make_rank(7)]
    rng = random.Random(3)
    trace, added = [[], []], [[], []]
    t, last = 50.0, 0.0
    for i in range(60):
        t += 0.02
        for k, sched in enumerate(ranks):
            if i % 7 == 0:
                added[k].append((Request(f"r{i}", [1] * (10 + 3 * i), SamplingParams(), arrival_time=None), t))
                sched.add_request(added[k][-1][0])
            sched.sync_clock(t, last)
            out = step(sched, finish_at=5)
            sched.record_step(out, rng.uniform(1, 9))   # each rank's own time: ignored
            trace[k].append(chunks(out))
        prompt = sum(n for _, n in trace[0][-1] if n > 1)   # rank 0's time for the step: what the fit sees
        last = 0.01 + 0.0003 * (len(trace[0][-1]) - (prompt > 0)) + 0.0002 * prompt + rng.uniform(0, 0.002)
    assert trace[0] == trace[1]
    assert any(2 < n < 64 for out in trace[0] for _, n in out if n > 1)   # paced chunks did happen
    assert ranks[1].step_cost.fit() == ranks[0].step_cost.fit() is not None
    assert ranks[1].prompt_mean.value == ranks[0].prompt_mean.value is not None
    for k in range(2):   # arrival: rank 0's clock at the first sync after the add
        assert [r.arrival_time for r, _ in added[k]] == [when for _, when in added[k]]
