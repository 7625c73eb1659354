"""Owns the device: the model, the KV cache, CUDA graphs, and one step's forward + sampling."""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from nanoserve.config import EngineConfig
from nanoserve.cpu_threads import cpu_compute_threads
from nanoserve.runner.attention import select_backend
from nanoserve.runner.batch import PromptScores, SampleOutput, SequenceWork, TokenMask
from nanoserve.runner.inputs import build_inputs
from nanoserve.runner.layers.ops import EAGER_OPS, compiled_ops
from nanoserve.runner.kv_cache import KVCache, blocks_for_cpu, blocks_for_gpu, local_kv_heads, profile_work
from nanoserve.runner.loader import fill_dummy_weights, load_weights
from nanoserve.runner.models.decoder import head_dim_of
from nanoserve.runner.models.registry import model_class
from nanoserve.runner.parallel import SINGLE, TensorParallel
from nanoserve.runner.penalties import PenaltyCounts
from nanoserve.runner.prompt_scoring import score_prompt
from nanoserve.runner.sampler import draw, draws_in_graph
from nanoserve.runner.warm_up import warm_up_work

logger = logging.getLogger(__name__)


@dataclass
class StepLogits:
    """A queued forward pass: the logits of its sampling rows (None when none samples)."""

    logits: torch.Tensor | None
    rows: list[SequenceWork]
    prompt: list[PromptScores] | None  # prompt logprobs, per asking sequence
    drawn: torch.Tensor | None = None  # a decode graph's own draw, for rows that ask no more of it


class PendingSample:
    """The sampled ids of a launched step. `result()` is the step's one device-to-host sync."""

    def __init__(self, tokens: torch.Tensor | None, logprobs: list | None, num_rows: int,
                 prompt_logprobs: list[PromptScores] | None = None) -> None:
        self.tokens, self.logprobs, self.num_rows = tokens, logprobs, num_rows
        self.prompt_logprobs = prompt_logprobs or []
        self.event = None
        if tokens is not None and tokens.is_cuda:
            # start the copy now; whoever waits later finds the ids already on the host
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def result(self) -> SampleOutput:
        if self.tokens is None:
            return SampleOutput([], [], self.prompt_logprobs)
        if self.event is not None:
            self.event.synchronize()
            ids = self.host.tolist()
        else:
            ids = self.tokens.tolist()
        return SampleOutput(ids, self.logprobs if self.logprobs is not None else [None] * self.num_rows,
                            self.prompt_logprobs)


class ModelRunner:
    """Runs steps of the engine's batches: build inputs, forward, logits on sampling rows, sample."""

    def __init__(self, config: EngineConfig, show_progress: bool = False, tp: TensorParallel | None = None) -> None:
        """Rank 0 (tp None) starts the tensor-parallel workers when the config asks for them."""
        self.config = config
        self.workers = []
        if tp is None and config.tensor_parallel_size > 1:
            from nanoserve.runner.workers import start_workers
            tp, self.workers = start_workers(config)
        self.tp = tp or SINGLE
        show_progress = show_progress and self.tp.rank == 0
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            threads = config.cpu_threads or cpu_compute_threads(config.tensor_parallel_size)
            if threads:
                torch.set_num_threads(threads)
        self.block_size = config.block_size
        hf = config.hf_config
        cls = model_class(hf)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(config.dtype)
        try:
            # fused elementwise kernels pay on the GPU; compiling would only slow the CPU path
            ops = compiled_ops() if self.device.type == "cuda" and not config.enforce_eager else EAGER_OPS
            with torch.device(self.device):
                self.model = cls(hf, ops, self.tp, config.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            fill_dummy_weights(self.model, config.seed)
        else:
            load_weights(self.model, config.model, cls.packed_modules, show_progress)
        self.model.eval()
        self.vocab_size = hf.vocab_size
        self.graphs = None
        self.prefill_graphs = None
        self.graph_capture_seconds = 0.0
        self.prev_tokens: torch.Tensor | None = None  # the last launch's sampled ids, on the device
        self.prev_rows = 0  # how many ids the last launch sampled (what a worker receives)
        self.penalty_counts = PenaltyCounts()  # penalized sequences' token counts, between steps
        self.backend = select_backend(config.attention_backend, config.device, config.block_size,
                                      config.kv_cache_dtype, config.dtype)
        uses_graphs = self.device.type == "cuda" and not config.enforce_eager and self.backend.supports_cuda_graphs
        if uses_graphs:
            # timed under graph replay, where decode runs; eager launches would add Triton's
            # Python launch cost to every step, so enforce_eager keeps cuBLAS throughout
            from nanoserve.runner.layers.skinny_choice import use_skinny_gemm_where_faster
            use_skinny_gemm_where_faster(self.model, config.max_num_seqs, self.device, ops.silu_mul, ops.add_rms_norm)
            from nanoserve.runner.cuda_graph import graph_batch_sizes
            from nanoserve.runner.layers.blas_choice import use_blas_lt_where_faster
            use_blas_lt_where_faster(self.model, graph_batch_sizes(config.max_num_seqs), self.device)
        draws_in_graphs = uses_graphs and self.tp.size == 1   # the LM head's gather stays out of graphs
        graphs_prefill = uses_graphs and config.prefill_cuda_graphs and self._prefill_graphs_supported()
        if self.device.type == "cuda":
            peak = activations = self.profile_peak_bytes()
            if draws_in_graphs:
                from nanoserve.runner.cuda_graph import logits_buffer_bytes
                peak += logits_buffer_bytes(config, self.vocab_size)
            graph_pool = 0
            if graphs_prefill:
                from nanoserve.runner.prefill_graph import prefill_graph_bytes
                graph_pool = prefill_graph_bytes(config, hf.hidden_size, activations)
            num_blocks = config.num_kvcache_blocks or blocks_for_gpu(config, peak, graph_pool)
        else:
            num_blocks = config.num_kvcache_blocks or blocks_for_cpu(config)
        if self.tp.size > 1:
            num_blocks = self.tp.min(num_blocks)  # every rank holds the same block ids
        self.kv_cache = KVCache(config, num_blocks, self.device)
        self._bind(self.kv_cache)
        if uses_graphs:
            from nanoserve.runner.cuda_graph import DecodeGraphs
            start = time.perf_counter()
            self.graphs = DecodeGraphs(self.model, config, show_progress, draws=draws_in_graphs)
            self.graph_capture_seconds = time.perf_counter() - start
            logger.info("captured %d CUDA graphs in %.1f s", len(self.graphs.sizes), self.graph_capture_seconds)
        if graphs_prefill:
            from nanoserve.runner.prefill_graph import PrefillGraphs
            start = time.perf_counter()
            self.prefill_graphs = PrefillGraphs(self.model, config, show_progress)
            seconds = time.perf_counter() - start
            self.graph_capture_seconds += seconds
            logger.info("captured %d prefill CUDA graphs (up to %d tokens) in %.1f s", len(self.prefill_graphs.sizes),
                        self.prefill_graphs.max_tokens, seconds)
        if self.device.type == "cuda":
            self._warm_up_eager_steps()
        if self.device.type == "cuda" and self.tp.rank == 0:
            from nanoserve.runner.sampling_kernel import warm_up
            warm_up(self.vocab_size, config.dtype, self.device)

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    def run(self, work: list[SequenceWork], token_mask: TokenMask | None = None) -> SampleOutput:
        """Compute every sequence's new tokens; sample one token for each row that asks."""
        return self.launch(work, token_mask).result()

    def launch(self, work: list[SequenceWork], token_mask: TokenMask | None = None) -> PendingSample:
        """Queue a step on the device and return without waiting for it.

        Rows with `prev_row` set read their input token from what the previous launch sampled.
        `token_mask` limits what the constrained sampling rows may draw (rank 0 alone samples)."""
        return self.sample(self.forward(work), token_mask)

    def forward(self, work: list[SequenceWork]) -> StepLogits:
        """Queue a step's forward pass (through the logits) without sampling it.

        `sample` must follow before the next `forward`: that launch reads the ids this one samples.
        Between the two the host may prepare what sampling needs (a grammar's mask) while the
        device computes."""
        if self.tp.size > 1:
            self.tp.broadcast([w.for_workers() for w in work])  # rank 0's step; the workers run the same one
        return self._forward(work)

    def serve_steps(self) -> None:
        """A worker's loop: run each step rank 0 broadcasts, until it broadcasts None."""
        while (work := self.tp.broadcast()) is not None:
            self.sample(self._forward(work))

    def close(self) -> None:
        """Stop the tensor-parallel workers, leave the process group (rank 0 and workers alike), and
        give the device memory back: a later engine in this process sizes its KV cache by what is free."""
        if self.tp.size > 1:
            if self.tp.rank == 0:
                self.tp.broadcast(None)
                for worker in self.workers:
                    worker.join(timeout=60)
            torch.distributed.destroy_process_group()
            self.tp = SINGLE
        self.graphs = self.prefill_graphs = self.kv_cache = self.prev_tokens = None
        self.model = None
        self.penalty_counts = PenaltyCounts()
        if self.device.type == "cuda":
            gc.collect()   # captured graphs and their pools sit in reference cycles
            torch.cuda.empty_cache()

    def _share_prev_tokens(self, work: list[SequenceWork]) -> None:
        """Give the workers the ids rank 0 sampled last step, where this step reads them on the device."""
        if any(w.prev_row >= 0 for w in work):
            if self.tp.rank != 0:
                self.prev_tokens = torch.empty(self.prev_rows, dtype=torch.int64, device=self.device)
            torch.distributed.broadcast(self.prev_tokens, src=0)
        self.prev_rows = sum(w.params is not None for w in work)

    @torch.inference_mode()
    def _forward(self, work: list[SequenceWork]) -> StepLogits:
        if self.tp.size > 1:
            self._share_prev_tokens(work)
        prompt = None
        if self.graphs is not None and self.graphs.fits(work):
            # a decode step: every row has one new token and samples from it
            out, drawn = self.graphs.run(work, self.prev_tokens)
            if drawn is not None:   # the graph ran the LM head and a draw too
                return StepLogits(out, work, None, drawn)
            hidden, rows = out, work
        elif self.prefill_graphs is not None and self.prefill_graphs.fits(work):
            hidden, rows = self.prefill_graphs.run(work, self.prev_tokens)
        else:
            hidden, rows, prompt = self._forward_eager(work)
        # every rank: the LM head gathers across ranks
        logits = self.model.compute_logits(hidden) if rows else None
        return StepLogits(logits, rows, prompt)

    def _forward_eager(self, work: list[SequenceWork]
                       ) -> tuple[torch.Tensor, list[SequenceWork], list[PromptScores] | None]:
        """A step outside the graphs: the sampling rows' hidden states, those rows, prompt logprobs."""
        inputs = build_inputs(work, self.block_size, self.device, self.prev_tokens)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        prompt = None
        if inputs.prompt_logprob_rows is not None:
            # read back now: only steps that carry such prompts pay this sync
            prompt = score_prompt(self.model.compute_logits, hidden, inputs.prompt_logprob_rows)
        return hidden[inputs.logits_indices], inputs.sample_rows, prompt

    @torch.inference_mode()
    def _warm_up_eager_steps(self) -> None:
        """Compile now what eager steps launch that neither the profiling step nor a graph capture
        does: mixed steps (past the largest prefill graph, or with prompt logprobs) and, without
        prefill graphs, decode-only steps (1-token prompt chunks beside decode rows; every step
        under enforce_eager)."""
        shapes = getattr(self.backend, "eager_step_shapes", None)
        if shapes is None:
            return
        start = time.perf_counter()
        cfg = self.config
        for mixed in (True, False) if self.prefill_graphs is None else (True,):
            for seqs, longest in shapes(mixed, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len,
                                        local_kv_heads(cfg), head_dim_of(cfg.hf_config), cfg.dtype, self.device,
                                        cfg.kv_cache_dtype == "fp8"):
                work = warm_up_work(seqs, longest, self.block_size, self.num_blocks, with_prompt=mixed)
                if work is not None:
                    self._forward_eager(work)
        torch.cuda.synchronize()
        logger.info("eager-step kernels ready in %.1f s", time.perf_counter() - start)

    @torch.inference_mode()
    def sample(self, step: StepLogits, token_mask: TokenMask | None = None) -> PendingSample:
        """Queue the sampling of a forward's logits; the ids stay on the device for the next launch."""
        if not step.rows:
            self.prev_tokens = None
            return PendingSample(None, None, 0, step.prompt)
        if self.tp.rank != 0:
            return PendingSample(None, None, 0)  # rank 0 alone samples
        if step.drawn is not None and token_mask is None and draws_in_graph(step.rows):
            # a copy: the bucket's next replay rewrites the draw before penalties could read it
            tokens, logprobs = step.drawn.clone(), None
        else:
            # prev_tokens still holds the previous launch's ids: penalties count the pending ones there
            tokens, logprobs = draw(step.logits, step.rows, token_mask, self.prev_tokens, self.penalty_counts)
        self.prev_tokens = tokens
        return PendingSample(tokens, logprobs, len(step.rows), step.prompt)

    @torch.inference_mode()
    def profile_peak_bytes(self) -> int:
        """Peak activation bytes of the largest step, measured with a throwaway KV cache."""
        cfg = self.config
        work = profile_work(cfg)
        cache = KVCache(cfg, sum(len(w.block_table) for w in work), self.device)
        self._bind(cache)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        self.run(work)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        self._bind(None)
        del cache
        torch.cuda.empty_cache()
        return peak

    def _prefill_graphs_supported(self) -> bool:
        """Prefill graphs replay the Triton prefill kernel, whose grid a bucket fixes. The config
        refuses what rules them out up front; only auto's pick of flash_attn is known no sooner."""
        if self.backend.name == "triton":
            return True
        logger.info("prefill CUDA graphs need the triton attention backend, not %s: prefill steps run eagerly",
                    self.backend.name)
        return False

    def _bind(self, cache: KVCache | None) -> None:
        """Point every attention layer at its slice of `cache` (None: at nothing)."""
        for i, layer in enumerate(layer.self_attn for layer in self.model.model.layers):
            k, v = cache.layer(i) if cache is not None else (torch.empty(0),) * 2
            layer.backend, layer.k_cache, layer.v_cache = self.backend, k, v
