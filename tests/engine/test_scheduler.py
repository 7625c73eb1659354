"""Continuous batching over the block manager, driven without a model: the test plays the engine."""

from __future__ import annotations

import collections

from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.scheduler import ScheduledStep, Scheduler, rank
from nanoserve.engine.sequence import Sequence, SequenceStatus
from nanoserve.sampling_params import SamplingParams


def fake_token_at(num_tokens: int) -> int:
    # a function of the position only: equal prompts get equal outputs, as with greedy decoding
    return num_tokens * 7 % 4


class FakeEngine:
    """Plays LLMEngine.step() on a scheduler: the runner computes the scheduled tokens and samples
    one more for every sequence whose chunk reaches its end; `max_tokens` ends a request.
    `kv[block][slot]` records which prefix the K/V written there belongs to."""

    def __init__(self, num_blocks: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True,
                 policy: str = "fcfs") -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, policy)
        self.seqs: dict[str, Sequence] = {}
        self.finish_order: list[str] = []
        self.kv: dict[int, dict[int, int]] = collections.defaultdict(dict)

    def add(self, request_id: str, prompt: list[int], max_tokens: int, priority: int = 0) -> Sequence:
        seq = Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens), arrival=len(self.seqs),
                       priority=priority)
        self.seqs[request_id] = seq
        self.sched.add(seq)
        return seq

    def step(self) -> ScheduledStep:
        step = self.sched.schedule()
        bs = self.bm.block_size
        for seq, n in zip(step.seqs, step.num_new_tokens):
            assert n >= 1 and not seq.is_finished
            assert seq.num_computed_tokens + n <= seq.num_tokens
            for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                self.kv[seq.block_table[p // bs]][p % bs] = hash(tuple(seq.token_ids[:p + 1]))
            seq.num_computed_tokens += n
            self.bm.commit(seq)
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(fake_token_at(seq.num_tokens))
                if seq.num_output_tokens >= seq.max_tokens:
                    self.sched.finish(seq, "length")
                    self.finish_order.append(seq.request_id)
        return step

    def run(self, max_steps: int = 1000) -> list[ScheduledStep]:
        steps = []
        while self.sched.has_work:
            assert len(steps) < max_steps, f"no progress after {max_steps} steps: {self.sched.running}"
            steps.append(self.step())
        return steps


def test_long_prompt_is_chunked_within_the_budget_beside_running_decodes():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    a = eng.add("a", [1, 2, 3, 4, 5], max_tokens=20)
    eng.step()
    b = eng.add("b", list(range(40)), max_tokens=2)

    chunks, outputs_of_b = [], []
    for _ in range(3):
        step = eng.step()
        assert sum(step.num_new_tokens) <= 16
        assert step.seqs[0] is a and step.num_new_tokens[0] == 1  # the decode keeps flowing
        assert step.seqs[1] is b
        chunks.append(step.num_new_tokens[1])
        outputs_of_b.append(b.num_output_tokens)
    assert chunks == [15, 15, 10]
    assert outputs_of_b == [0, 0, 1]  # sampled only once the last chunk ends the prompt
    step = eng.step()
    assert step.seqs == [a, b] and step.num_new_tokens == [1, 1]
    eng.run()
    assert a.num_output_tokens == 20 and b.num_output_tokens == 2


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                     enable_chunked_prefill=False)
    a = eng.add("a", [1, 2, 3, 4, 5], max_tokens=4)
    b = eng.add("b", list(range(12)), max_tokens=2)
    step = eng.step()
    assert step.seqs == [a] and step.num_new_tokens == [5]  # 5 + 12 > 16: b does not start cut
    step = eng.step()
    assert step.seqs == [a, b] and step.num_new_tokens == [1, 12]
    eng.run()
    assert b.is_finished and a.is_finished


def test_max_num_seqs_caps_the_running_sequences():
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        eng.add(f"r{i}", [i + 1, 9, 9], max_tokens=3)
    first = eng.step()
    assert [s.request_id for s in first.seqs] == ["r0", "r1"]
    while eng.sched.has_work:
        step = eng.step()
        assert len(step.seqs) <= 2 and len(eng.sched.running) <= 2
    assert eng.finish_order == ["r0", "r1", "r2", "r3", "r4"]


def test_preemption_takes_the_newest_running_sequence_and_requeues_it_first():
    eng = FakeEngine(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    a = eng.add("a", [1, 1, 1, 1], max_tokens=3)       # 1 block, needs a 2nd for its first output
    b = eng.add("b", [2, 2, 2, 2, 2], max_tokens=3)    # 2 blocks
    c = eng.add("c", [3, 3, 3], max_tokens=3)          # 1 block: the cache is now full
    eng.step()
    d = eng.add("d", [4, 4, 4], max_tokens=3)
    assert eng.bm.num_free_blocks == 0

    step = eng.step()
    assert step.num_preempted == 1
    assert step.seqs == [a, b]  # nothing new starts in a step that had to preempt
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and c.num_preemptions == 1
    assert list(eng.sched.waiting) == [c, d]
    assert c.output_token_ids == [fake_token_at(3)]  # what it sampled is kept and recomputed

    eng.run()
    assert eng.sched.num_preemptions >= 1
    for seq in (a, b, c, d):
        assert seq.is_finished and seq.num_output_tokens == 3
    assert eng.finish_order.index("c") < eng.finish_order.index("d")
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_prompt_needing_almost_the_whole_cache_completes_beside_running_sequences():
    for prefix_caching in (True, False):
        # 10 blocks of 4 = 40 tokens; the big request needs all of them by its end
        eng = FakeEngine(num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                         enable_prefix_caching=prefix_caching)
        a = eng.add("a", [1, 2, 3], max_tokens=12)
        b = eng.add("b", [3, 2, 1], max_tokens=12)
        eng.step()
        big = eng.add("big", list(range(100, 134)), max_tokens=6)
        late = eng.add("late", [5, 5], max_tokens=3)
        eng.run(max_steps=500)
        for seq in (a, b, big, late):
            assert seq.is_finished and seq.num_output_tokens == seq.max_tokens, seq
        assert big.num_preemptions >= 1  # its chunks started beside a and b, and had to give way
        assert eng.bm.num_free_blocks == 10


def test_prefix_hits_are_counted_once_per_admission_not_per_attempt():
    eng = FakeEngine(num_blocks=16, block_size=4, max_num_seqs=4, max_num_batched_tokens=16,
                     enable_chunked_prefill=False)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    eng.add("p", prefix, max_tokens=1)
    eng.step()                                        # p's two full blocks are now cached
    r = eng.add("r", list(range(20, 30)), max_tokens=3)
    c = eng.add("c", prefix + [40, 41, 42, 43, 44, 45], max_tokens=2)  # 8 cached + 7 to compute
    assert eng.step().seqs == [r]                     # 10 + 7 > 16: c looks up its prefix but must wait
    assert eng.step().seqs == [r, c]
    eng.run()
    assert c.num_cached_tokens == 8
    assert eng.bm.prefix_hit_tokens == 8
    assert eng.bm.prefix_queried_tokens == 9 + 10 + 15


# --- property test: random add / step / abort sequences ---

PREFIXES = [[], [1, 2, 3, 0, 1, 2, 3, 0, 1], [1, 2, 3, 0, 2, 2]]

add_op = st.tuples(st.just("add"), st.integers(0, len(PREFIXES) - 1),
                   st.lists(st.integers(0, 1), max_size=12), st.integers(1, 16))
abort_op = st.tuples(st.just("abort"), st.integers(0, 30))
ops_strategy = st.lists(st.one_of(add_op, add_op, st.just(("step",)), st.just(("step",)), abort_op),
                        min_size=10, max_size=40)


# None: first come, first served; else the priority policy with these priorities, by request
priorities_strategy = st.tuples(st.booleans(), st.lists(st.integers(-2, 2), min_size=40, max_size=40)).map(
    lambda drawn: drawn[1] if drawn[0] else None)


def check_queue_order(sched: Scheduler) -> None:
    """Under the priority policy both queues stay in rank order."""
    if sched.by_priority:
        assert list(sched.waiting) == sorted(sched.waiting, key=rank)
        assert sched.running == sorted(sched.running, key=rank)


def check_invariants(eng: FakeEngine) -> None:
    bm, sched, kv = eng.bm, eng.sched, eng.kv
    assert min(bm.ref_counts) >= 0
    assert set(bm.free) == {b for b, r in enumerate(bm.ref_counts) if r == 0}
    live = list(sched.waiting) + sched.running
    assert len({id(s) for s in live}) == len(live), "a sequence is queued twice"
    assert all(not s.is_finished for s in live)
    assert all(not s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
    held = collections.Counter(b for s in live for b in s.block_table)
    assert all(len(set(s.block_table)) == len(s.block_table) for s in live)
    assert held == collections.Counter({b: r for b, r in enumerate(bm.ref_counts) if r > 0})
    assert sum(bm.ref_counts) == sum(len(s.block_table) for s in live)
    for s in sched.running:
        assert len(s.block_table) == -(-s.num_computed_tokens // bm.block_size)
        # every computed position reads the K/V of its own prefix (prefix hits included)
        for p in range(s.num_computed_tokens):
            assert kv[s.block_table[p // bm.block_size]][p % bm.block_size] == hash(tuple(s.token_ids[:p + 1]))
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h
    check_queue_order(sched)


def request_of(op: tuple, max_model_len: int) -> tuple[list[int], int]:
    """The prompt and max_tokens of an ("add", prefix, tail, max_tokens) op, cut to fit the context."""
    _, prefix, tail, max_tokens = op
    prompt = (PREFIXES[prefix] + tail)[:max_model_len - 1] or [0]
    return prompt, min(max_tokens, max_model_len - len(prompt))


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(num_blocks=st.integers(4, 8), block_size=st.sampled_from([2, 4]), max_num_seqs=st.integers(1, 4),
       budget=st.integers(4, 24), prefix_caching=st.booleans(), chunked=st.booleans(), ops=ops_strategy,
       priorities=priorities_strategy)
def test_random_add_step_abort_never_leaks_blocks_or_loses_requests(num_blocks, block_size, max_num_seqs,
                                                                     budget, prefix_caching, chunked, ops, priorities):
    max_model_len = num_blocks * block_size  # the engine's config guarantees one sequence fits
    if not chunked:  # as EngineConfig demands: a whole prompt must fit in one step's budget
        budget = max(budget, max_model_len)
    eng = FakeEngine(num_blocks, block_size, max_num_seqs, max(budget, max_num_seqs), prefix_caching, chunked,
                     "fcfs" if priorities is None else "priority")
    aborted: set[str] = set()
    total_tokens = 0

    def step() -> None:
        scheduled = eng.step()
        assert sum(scheduled.num_new_tokens) <= eng.sched.max_num_batched_tokens
        assert len(eng.sched.running) <= max_num_seqs
        check_invariants(eng)

    for op in ops:
        if op[0] == "add":
            prompt, max_tokens = request_of(op, max_model_len)
            eng.add(f"r{len(eng.seqs)}", prompt, max_tokens, priorities[len(eng.seqs)] if priorities else 0)
            total_tokens += len(prompt) + max_tokens
        elif op[0] == "step":
            step()
        else:
            live = [rid for rid, s in eng.seqs.items() if not s.is_finished]
            if live:
                rid = live[op[1] % len(live)]
                event(f"abort a {eng.seqs[rid].status.value} request")
                assert eng.sched.abort(rid) is eng.seqs[rid]
                aborted.add(rid)
                check_invariants(eng)

    # the oldest running sequence progresses every step, so the work drains in bounded time
    for _ in range(4 * total_tokens + 10):
        if not eng.sched.has_work:
            break
        step()
    assert not eng.sched.has_work, "requests are stuck"
    # steer the search towards the hard cases: many preemptions and prefix hits
    target(float(eng.sched.num_preemptions), label="preemptions")
    target(float(eng.bm.prefix_hit_tokens), label="prefix hit tokens")
    event(f"preempted: {eng.sched.num_preemptions > 0}")
    event(f"prefix hits: {eng.bm.prefix_hit_tokens > 0}")

    for rid, seq in eng.seqs.items():
        assert seq.is_finished
        if rid in aborted:
            assert seq.finish_reason == "abort"
        else:
            assert seq.finish_reason == "length" and seq.num_output_tokens == seq.max_tokens
    assert eng.bm.num_free_blocks == num_blocks
    assert eng.bm.ref_counts == [0] * num_blocks


# --- the same random operations through the real engine: LLMEngine's launch / complete path ---

_reference_outputs: dict[tuple, list[int]] = {}


def reference_greedy(model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """The prompt's greedy tokens alone in a roomy engine, remembered across examples."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine

    key = (tuple(prompt), max_tokens)
    if key not in _reference_outputs:
        if "engine" not in _reference_outputs:
            _reference_outputs["engine"] = LLMEngine(EngineConfig(model=model, device="cpu", max_model_len=64,
                                                                  num_kvcache_blocks=64, block_size=4))
        eng = _reference_outputs["engine"]
        eng.add_request("ref", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        tokens: list[int] = []
        while eng.has_unfinished_requests():
            tokens += [t for out in eng.step() for t in out.new_token_ids]
        _reference_outputs[key] = tokens
    return _reference_outputs[key]


def check_engine_invariants(engine) -> None:
    bm, sched = engine.block_manager, engine.scheduler
    assert min(bm.ref_counts) >= 0
    assert set(bm.free) == {b for b, r in enumerate(bm.ref_counts) if r == 0}
    live = list(sched.waiting) + sched.running
    assert len({id(s) for s in live}) == len(live), "a sequence is queued twice"
    assert all(not s.block_table for s in sched.waiting), "a waiting sequence holds blocks"
    held = collections.Counter(b for s in live for b in s.block_table)
    assert held == collections.Counter({b: r for b, r in enumerate(bm.ref_counts) if r > 0}), "a block leaked"
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h
    check_queue_order(sched)


@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(num_blocks=st.integers(4, 8), block_size=st.sampled_from([2, 4]), max_num_seqs=st.integers(1, 4),
       budget=st.integers(4, 24), prefix_caching=st.booleans(), chunked=st.booleans(),
       async_scheduling=st.booleans(), forks=st.integers(0, 1), ops=ops_strategy, priorities=priorities_strategy)
def test_random_add_step_abort_through_the_real_engine(qwen3_model, num_blocks, block_size, max_num_seqs, budget,
                                                        prefix_caching, chunked, async_scheduling, forks, ops,
                                                        priorities):
    """LLMEngine with a real (tiny, random) model: no leaked block, no lost request, and every
    request that ran to its end got the tokens it gets alone, preemptions and prefix hits or not."""
    from nanoserve.config import EngineConfig
    from nanoserve.engine.llm_engine import LLMEngine

    max_model_len = num_blocks * block_size
    if not chunked:
        budget = max(budget, max_model_len)
    engine = LLMEngine(EngineConfig(
        model=qwen3_model, device="cpu", max_model_len=max_model_len, num_kvcache_blocks=num_blocks,
        block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max(budget, max_num_seqs),
        enable_prefix_caching=prefix_caching, enable_chunked_prefill=chunked, async_scheduling=async_scheduling,
        scheduling_policy="fcfs" if priorities is None else "priority"))
    requests: dict[str, tuple[list[int], int]] = {}
    outputs: dict[str, list[int]] = collections.defaultdict(list)
    finished: dict[str, str] = {}
    aborted: set[str] = set()

    def step() -> None:
        for out in engine.step():
            assert out.request_id not in finished, "output after the request finished"
            outputs[out.request_id] += out.new_token_ids
            if out.finished:
                finished[out.request_id] = out.finish_reason
        assert len(engine.scheduler.running) <= max_num_seqs
        check_engine_invariants(engine)

    for op in ops:
        if op[0] == "add":
            prompt, max_tokens = request_of(op, max_model_len)
            rid = f"r{len(requests)}"
            fork_ids = [f"{rid}-fork{i}" for i in range(forks)]
            engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               fork_ids=fork_ids, priority=priorities[len(requests) % 40] if priorities else 0)
            for r in (rid, *fork_ids):
                requests[r] = (prompt, max_tokens)
        elif op[0] == "step":
            step()
        else:
            live = [rid for rid in engine.sequences]
            if live:
                rid = live[op[1] % len(live)]
                engine.abort_request(rid)
                aborted.add(rid)
                check_engine_invariants(engine)

    total_tokens = sum(len(p) + m for p, m in requests.values())
    for _ in range(4 * total_tokens + 10):
        if not engine.has_unfinished_requests():
            break
        step()
    assert not engine.has_unfinished_requests(), "requests are stuck"
    event(f"preempted: {engine.scheduler.num_preemptions > 0}")
    event(f"prefix hits: {engine.block_manager.prefix_hit_tokens > 0}")
    event(f"aborted: {bool(aborted)}")
    event(f"policy: {engine.config.scheduling_policy}")
    assert engine.sequences == {} and engine.pending_forks == {}
    assert engine.block_manager.num_free_blocks == num_blocks
    assert engine.block_manager.ref_counts == [0] * num_blocks
    for rid, (prompt, max_tokens) in requests.items():
        if rid in aborted:
            continue  # aborted: whatever it produced before, it produced nothing after
        assert finished.get(rid) == "length", f"{rid} never finished"
        assert outputs[rid] == reference_greedy(qwen3_model, prompt, max_tokens), rid
