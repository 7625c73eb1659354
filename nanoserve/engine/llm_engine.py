"""The synchronous engine core: add requests, step the scheduler and the model runner."""

from __future__ import annotations

import bisect
import concurrent.futures
import itertools
import logging
import time
from typing import TYPE_CHECKING

from nanoserve.config import EngineConfig
from nanoserve.engine.bad_words import BadWords, with_bad_words_token_ids
from nanoserve.engine.block_manager import BlockManager
from nanoserve.engine.grammar_queue import GrammarQueue
from nanoserve.engine.grammar_state import GrammarStateGuard
from nanoserve.engine.in_flight import InFlightStep
from nanoserve.engine.messages import STEP_TOKEN_BUCKETS, EngineStats, StepOutput
from nanoserve.engine.reasoning_gate import reasoning_gate
from nanoserve.engine.scheduler import Scheduler
from nanoserve.engine.sequence import Sequence
from nanoserve.engine.token_rules import banned_tokens, finish_reason
from nanoserve.engine.tokenizer import eos_token_ids, load_tokenizer
from nanoserve.runner.batch import PENDING_TOKEN, SequenceWork
from nanoserve.runner.model_runner import ModelRunner
from nanoserve.sampling_params import SamplingParams, fork_seed, max_tokens_in_context

if TYPE_CHECKING:  # xgrammar loads with the first structured-output request, not with the engine
    import numpy as np
    import xgrammar as xgr

    from nanoserve.engine.grammar import GrammarManager

logger = logging.getLogger(__name__)


class LLMEngine:
    """Owns the scheduler, block manager and runner. Not thread-safe: one thread calls it."""

    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer, config.trust_remote_code)
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer, config.hf_config)
        self.runner = ModelRunner(config, show_progress)
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.kv_window)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.enable_chunked_prefill, config.scheduling_policy)
        self.vocab_size = config.hf_config.vocab_size
        self.sequences: dict[str, Sequence] = {}
        self.pending_forks: dict[str, list[str]] = {}  # request id -> siblings waiting for its prompt
        self.in_flight: InFlightStep | None = None  # launched, sampled ids not read yet
        self.closed = False
        self._arrivals = itertools.count()
        self.num_generated_tokens = 0  # ever, for the stats
        self.num_computed_tokens = 0
        self.step_token_counts = [0] * (len(STEP_TOKEN_BUCKETS) + 1)   # steps by their tokens, +Inf last
        self._grammars: GrammarManager | None = None  # built with the first structured-output request
        # structured-output requests until their grammar is compiled and fits the budget of grammars
        # in use: not scheduled before, so they wait without holding a KV block or anyone else up
        self.grammar_queue = GrammarQueue(lambda spec: self.grammars.compile(spec), config.max_grammar_bytes)
        # (request ids, why) of requests dropped because their grammar failed to compile; the core
        # reports them as RequestFailed (the front end validates specs first, so this is rare)
        self.failures: list[tuple[list[str], str]] = []
        # a matcher's state grows with every token it accepts, unbounded by xgrammar (grammar_state.py)
        self.grammar_state = GrammarStateGuard(config.max_grammar_state_bytes)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    fork_ids: list[str] | tuple[str, ...] = (), priority: int = 0) -> None:
        """Queue a request checked by `validation.check_prompt`; output stops at max_model_len if it must.

        `fork_ids` name sibling requests (n > 1) with the same prompt and params. They start once
        this request's prompt is in the KV cache, so they share its blocks instead of n prefills.
        `priority` orders requests under the priority policy (lower first); first come first served
        ignores it.
        """
        self._check_open()
        for rid in (request_id, *fork_ids):
            if rid in self.sequences or rid in self.pending_forks:
                raise ValueError(f"Request id {rid!r} is already in use")
        if fork_ids:  # before queueing: a request that fails at once must take its forks with it
            self.pending_forks[request_id] = list(fork_ids)
        self._enqueue(request_id, prompt_token_ids, params, priority)

    def _enqueue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int,
                 fork_of: Sequence | None = None) -> None:
        # the front end tokenized them already; an offline request's here, and its forks share them
        params = with_bad_words_token_ids(params, self.tokenizer)
        # a fork keeps its request's place: its arrival, and ahead of later requests
        arrival = next(self._arrivals) if fork_of is None else fork_of.arrival
        front = fork_of is not None
        seq = Sequence(request_id, prompt_token_ids, params, arrival, priority)
        seq.max_tokens = max_tokens_in_context(seq.max_tokens, len(prompt_token_ids), self.config.max_model_len)
        seq.stop_token_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.eos_token_ids))
        self.sequences[request_id] = seq
        if params.bad_words:
            seq.bad_words = BadWords(params.bad_words_token_ids, self.vocab_size)
        if params.structured_outputs is not None:
            # forks share their running request's grammar and keep its place; others queue for theirs
            compiled = self.grammar_queue.share(seq) if front else None
            if compiled is None:
                self.grammar_queue.add(seq, first=front)
                return
            self._hold_to(seq, compiled)
        self.scheduler.add(seq, first=front)

    @property
    def grammars(self) -> GrammarManager:
        # built on first use: its vocabulary scan takes a while for a large tokenizer, and most
        # deployments never see a structured-output request
        if self._grammars is None:
            from nanoserve.engine.grammar import GrammarManager
            self._grammars = GrammarManager(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids),
                                            pin_memory=self.runner.device.type == "cuda")
        return self._grammars

    def _hold_to(self, seq: Sequence, compiled: xgr.CompiledGrammar) -> None:
        """Give a sequence its matcher at the grammar's start, and its reasoning gate where it has one."""
        seq.grammar = self.grammars.matcher(compiled, seq.stop_token_ids)
        seq.gate = reasoning_gate(seq.params.structured_outputs)

    def _fail(self, seq: Sequence, why: str) -> None:
        """Drop a request whose grammar cannot compile (and its forks); the core reports it."""
        logger.warning("Request %s failed: %s", seq.request_id, why)
        del self.sequences[seq.request_id]
        self.failures.append(([seq.request_id, *self.pending_forks.pop(seq.request_id, [])], why))

    def _end(self, seq: Sequence, why: str) -> None:
        """End a running request for what it alone holds (its grammar's state); the core reports it."""
        logger.warning("Request %s ended: %s", seq.request_id, why)
        self.abort_request(seq.request_id)
        seq.grammar = None   # its matcher's memory goes now, not once a step in flight lets go of it
        self.failures.append(([seq.request_id], why))

    def take_failures(self) -> list[tuple[list[str], str]]:
        """(request ids, why) of the requests dropped since the last call; they produce no outputs."""
        failures, self.failures = self.failures, []
        return failures

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar is compiled and fits the budget of grammars in use."""
        if not self.grammar_queue:
            return
        compiling = self.grammar_queue.compiling()
        if compiling and not self.scheduler.has_work and self.in_flight is None:
            # nothing else to run: wait for a compile instead of spinning (briefly, so adds and
            # aborts from the inbox are still taken promptly)
            concurrent.futures.wait(compiling, timeout=0.01, return_when=concurrent.futures.FIRST_COMPLETED)
        ready, failed = self.grammar_queue.admit()
        for seq, compiled in ready:
            self._hold_to(seq, compiled)
            self.scheduler.add(seq)
        for seq, why in failed:
            self._fail(seq, why)

    def _start_forks(self, parent: Sequence) -> None:
        forks = self.pending_forks.pop(parent.request_id, [])
        shared = parent.params
        if shared.prompt_logprobs is not None and forks:
            # the prompt's logprobs are the parent's: scoring it again would skip the prefix
            # cache and prefill the whole prompt once per choice (n=128 of 2k tokens: 217 s)
            shared = shared.derived(prompt_logprobs=None)
        for index in reversed(range(len(forks))):
            params = shared
            if params.seed is not None:
                # one seed for all n choices would draw n equal completions (vLLM offsets it too);
                # past the top of the seed range the offset wraps around to its bottom. Derived,
                # not checked again per fork (up to 128 of them, in the engine's loop)
                params = shared.derived(seed=fork_seed(shared.seed, index + 1))
            self._enqueue(forks[index], parent.prompt_token_ids, params, parent.priority, fork_of=parent)

    def abort_request(self, request_id: str) -> bool:
        """Forget a request and free its blocks at once; False if it is unknown or done."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            for forks in self.pending_forks.values():
                if request_id in forks:  # a sibling still waiting for its first: it never starts
                    forks.remove(request_id)
                    return True
            return False
        self._start_forks(seq)  # siblings are requests of their own and live on (sharing its grammar)
        if self.grammar_queue.remove(seq):
            return True
        self.grammar_queue.release(seq)
        return self.scheduler.abort(request_id) is not None

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any; the engine serves nothing afterwards."""
        if self._grammars is not None:
            self._grammars.close()
        self.in_flight = None   # its tensors are on the device
        self.closed = True
        self.runner.close()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; False while requests are in flight, which hold its blocks."""
        self._check_open()
        return not self.has_unfinished_requests() and self.block_manager.reset_prefix_cache()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("This engine is closed: its device memory was given back. Start a new LLM")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work or self.in_flight is not None or bool(self.grammar_queue)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences queued, siblings (n > 1) that wait for their first's prompt and requests that
        wait for their grammar included."""
        return (len(self.scheduler.waiting) + sum(map(len, self.pending_forks.values()))
                + len(self.grammar_queue))

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(self.num_running, self.num_waiting, bm.num_blocks, bm.num_free_blocks,
                           bm.prefix_queried_tokens, bm.prefix_hit_tokens, self.scheduler.num_preemptions,
                           self.num_generated_tokens, self.num_computed_tokens, list(self.step_token_counts))

    def step(self) -> list[StepOutput]:
        """Run one scheduled batch; report the tokens each request gained and who finished.

        With async scheduling the next batch is launched before this one's sampled ids are read,
        so the host's bookkeeping overlaps the device's work and outputs arrive one step later."""
        budget = self.grammar_queue.budget
        self.grammar_state.enforce(len(budget) > 0, budget.bytes, self.sequences.values(), self._end)
        if self._grammars is not None:
            self._grammars.clock.end_slow(self.sequences.values(), self._end)
        self._admit_compiled()
        if self.config.async_scheduling:
            launched = self._launch()
            deferred = launched if launched is not None and launched.pending is None else None
            outputs = self._complete(self.in_flight, deferred) if self.in_flight else []
            self.in_flight = launched
            return outputs
        launched = self._launch()
        return self._complete(launched) if launched else []

    def _sample(self, launched: InFlightStep) -> None:
        """Queue the sampling of a launched forward pass, under its grammar rows' masks.

        The masks are filled (on xgrammar's threads) while the device still runs the forward. A
        sequence that has finished or left since the launch samples unconstrained: its token is
        dropped anyway."""
        for row in launched.listening:
            # every token before this row's is known now: its bad words' bans are exact
            seq, w = launched.sequences[row], launched.rows[row]
            ban = banned_tokens(seq, w.start + w.num_new)
            if seq.grammar is None:
                w.banned_token_ids = ban   # read by the runner's sampler, which has not run yet
            elif ban:
                launched.bans[row] = ban
            else:
                launched.bans.pop(row, None)
        mask = None
        if launched.constrained:
            # a constrained row's allow list goes into its mask (the sampler leaves such rows to it)
            # one array per allow list, which a request's choices share: its bits are made once per step
            arrays: dict[int, np.ndarray] = {}
            allowed = {row: arrays.setdefault(id(ids), params.allowed_token_ids_array)
                       for row in launched.constrained
                       if (ids := (params := launched.sequences[row].params).allowed_token_ids) is not None}
            gates = {row: gate for row in launched.constrained
                     if (gate := launched.sequences[row].gate) is not None and not gate.answering}
            mask = self._grammars.bitmask(self._live_matchers(launched.sequences), launched.bans, allowed, gates)
        launched.pending = self.runner.sample(launched.forward, mask)
        launched.forward = None

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> int | None:
        """Top-N of prompt logprobs when this chunk still scores prompt tokens, else None."""
        if seq.prompt_logprobs is None or seq.num_computed_tokens >= seq.num_prompt_tokens - 1:
            return None
        return seq.params.prompt_logprobs

    def _live_matchers(self, sampling: list[Sequence]) -> list:
        """Each row's matcher, None where the sequence has none or has finished or left."""
        return [seq.grammar if self.sequences.get(seq.request_id) is seq else None for seq in sampling]

    def _launch(self) -> InFlightStep | None:
        step = self.scheduler.schedule()
        if not step:
            return None
        # a grammar's row bans through its mask (the grammar may allow nothing but a stop token)
        work = [SequenceWork(seq.token_ids, seq.num_prompt_tokens, seq.num_computed_tokens, n, seq.block_table,
                             seq.params if seq.num_computed_tokens + n == seq.num_tokens else None,
                             banned_tokens(seq) if seq.grammar is None else (), seq.pending_row,
                             self._prompt_logprobs(seq), seq.seq_id)
                for seq, n in zip(step.seqs, step.num_new_tokens)]
        sampling = [seq for seq, w in zip(step.seqs, work) if w.params is not None]
        constrained = ([row for row, seq in enumerate(sampling) if seq.grammar is not None]
                       if self._grammars is not None else [])
        bans = {row: ban for row in constrained if (ban := banned_tokens(sampling[row]))}
        listening = [row for row, seq in enumerate(sampling) if seq.bad_words is not None and seq.bad_words.needs_history]
        # the rows' work is kept only for the listening rows' bans: no second pass over a plain step
        rows = [w for w in work if w.params is not None] if listening else []
        launched = InFlightStep(self.runner.forward(work), sequences=sampling, constrained=constrained, bans=bans,
                                rows=rows, listening=listening)
        if self.in_flight is None or not (constrained or listening):
            # every matcher has seen every token: sample now (before the placeholders go in)
            self._sample(launched)
        tokens = sum(step.num_new_tokens)
        self.num_computed_tokens += tokens
        self.step_token_counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, tokens)] += 1
        for seq, n, w in zip(step.seqs, step.num_new_tokens, work):
            if w.prompt_logprobs is not None:
                launched.scored.append((seq, seq.num_computed_tokens))
            seq.num_computed_tokens += n
            if w.params is None:
                continue
            seq.pending_row = len(launched.positions)
            seq.token_ids.append(PENDING_TOKEN)
            launched.positions.append(len(seq.token_ids) - 1)
            if len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_tokens:
                # done whatever the token turns out to be: free its place for the next launch now
                # (its blocks are rewritten only by later launches, which run after this one)
                first_pending = len(seq.token_ids) - (2 if w.prev_row >= 0 else 1)
                self.block_manager.commit(seq, first_pending)
                self.scheduler.finish(seq, "length")
        return launched

    def _complete(self, launched: InFlightStep, deferred: InFlightStep | None = None) -> list[StepOutput]:
        """Read a launched step's sampled ids back; update, stop and report its sequences.

        `deferred`: a launched step whose sampling waits for its grammar masks. It is queued as
        soon as the matchers have advanced, before the bookkeeping below: the device then has it
        before it finishes the forward pass, whatever the host does next."""
        sampled = launched.pending.result()
        self.num_generated_tokens += len(launched.sequences)
        for (seq, start), scores in zip(launched.scored, sampled.prompt_logprobs):
            seq.prompt_logprobs.write(start, scores)
        complete: set[int] = set()   # ids of the sequences whose grammar has just terminated
        if launched.constrained:
            # every live constrained row advances its matcher in one call, on xgrammar's threads
            live = [(row, seq) for row in launched.constrained
                    if self.sequences.get((seq := launched.sequences[row]).request_id) is seq]
            # a sequence still reasoning keeps its matcher at the start (reasoning_gate.py)
            steps = []
            for row, seq in live:
                token = sampled.token_ids[row]
                if seq.gate is None or seq.gate.passes(token):
                    steps.append((seq.grammar, token))
            self._grammars.advance(steps)
            complete = {id(seq) for _, seq in live if seq.grammar.is_terminated()}
        # the tokens just read go in first: the deferred step's bad-word bans look back at them
        for seq, position, token in zip(launched.sequences, launched.positions, sampled.token_ids):
            seq.token_ids[position] = token
        if deferred is not None:
            self._sample(deferred)  # its matchers have now seen the tokens just read
        outputs = []
        for row, (seq, position) in enumerate(zip(launched.sequences, launched.positions)):
            token = sampled.token_ids[row]
            if seq.pending_row == row and len(seq.token_ids) == position + 1:
                seq.pending_row = -1
            if self.sequences.get(seq.request_id) is not seq:
                continue  # aborted, or finished by a stop token in the step before
            self.block_manager.commit(seq, position + 1)
            if seq.request_id in self.pending_forks:
                self._start_forks(seq)
            reason = finish_reason(seq, token, position + 1 - seq.num_prompt_tokens)
            if reason is None and id(seq) in complete:
                reason = "stop"  # the grammar is complete (it ends on a stop token even with ignore_eos)
            if reason is not None:
                if not seq.is_finished:
                    self.scheduler.finish(seq, reason)
                del self.sequences[seq.request_id]
                self.grammar_queue.release(seq)
            logprob = sampled.logprobs[row]
            first = position == seq.num_prompt_tokens
            # readmitted after a preemption, its outputs may be cached too: usage counts prompt tokens only
            cached = min(seq.num_cached_tokens, seq.num_prompt_tokens)
            scored = seq.prompt_logprobs.packed() if first and seq.prompt_logprobs is not None else None
            output = StepOutput(seq.request_id, [token], [logprob] if logprob is not None else None,
                                reason is not None, reason, seq.num_prompt_tokens, cached, scored)
            if first and seq.scheduled_at is not None:
                output.timing = (seq.scheduled_at - seq.added_at, time.monotonic() - seq.scheduled_at)
            outputs.append(output)
        return outputs
