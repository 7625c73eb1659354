"""Triton and flash-attn attention backends on the GPU against the torch reference in float32:
bf16/fp16, batch mixes, GQA 1/4/8, head dims 64/128, block sizes 16/64/256, prefix history,
contexts up to 32k, and decode under CUDA graph capture and replay."""

from __future__ import annotations

import random

import pytest
import torch

from nanoserve.runner.attention import TorchBackend, select_backend
from nanoserve.runner.attention.decode_splits import longest_first
from nanoserve.runner.attention.triton_decode import paged_decode
from nanoserve.runner.attention.triton_kernels import TritonBackend, store_kvcache
from nanoserve.runner.batch import AttentionMetadata

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def make_step(specs: list[tuple[int, int]], *, block_size: int, kv_heads: int, group: int,
              head_dim: int, dtype: torch.dtype, seed: int, max_blocks: int | None = None,
              num_blocks: int | None = None):
    """Sequences as (q_len, seq_len) with seq_len - q_len keys of random history in a cache of
    shuffled physical blocks; seq_len 0 is a padding row (slot -1, no blocks)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for _, s in specs]
    num_blocks = max(num_blocks or 0, sum(blocks_per_seq) + 4)
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max_blocks or max(blocks_per_seq) + 1
    block_tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    slots, used = [], 0
    for i, ((q_len, seq_len), n) in enumerate(zip(specs, blocks_per_seq)):
        table = perm[used:used + n]
        used += n
        block_tables[i, :n] = table.int()
        if seq_len == 0:
            slots += [-1] * q_len
            continue
        pos = torch.arange(seq_len - q_len, seq_len)
        slots += (table[pos // block_size] * block_size + pos % block_size).tolist()
    dev = "cuda"
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    num_tokens = sum(q for q, _ in specs)
    torch.manual_seed(seed)
    k_cache = torch.randn(cache_shape, device=dev, dtype=dtype)
    v_cache = torch.randn(cache_shape, device=dev, dtype=dtype)
    q = torch.randn(num_tokens, kv_heads * group, head_dim, device=dev, dtype=dtype)
    kv = torch.randn(num_tokens, 2, kv_heads, head_dim, device=dev, dtype=dtype)
    q_lens, seq_lens = [q for q, _ in specs], [s for _, s in specs]
    # seq_lens and block tables are strided views of one buffer: the kernels must not assume more
    lens_and_tables = torch.cat([torch.tensor(seq_lens, dtype=torch.int32)[:, None],
                                 block_tables], dim=1).to(dev)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        query_start_loc=torch.tensor([0] + q_lens, device=dev).cumsum(0, dtype=torch.int32),
        seq_lens=lens_and_tables[:, 0],
        block_tables=lens_and_tables[:, 1:],
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        query_lens_host=q_lens, seq_lens_host=seq_lens,
    )
    return q, kv[:, 0], kv[:, 1], k_cache, v_cache, meta


def reference(q, k, v, k_cache, v_cache, meta, scale):
    kc, vc = k_cache.float(), v_cache.float()   # copies
    out = TorchBackend().forward(q.float(), k.float(), v.float(), kc, vc, meta, scale)
    return out, kc, vc


def assert_close(actual, expected, dtype):
    assert actual.isfinite().all()
    err = ((actual.float() - expected).norm() / expected.norm()).item()
    assert err < TOL[dtype], f"relative error {err:.2e} over {TOL[dtype]:.0e}"


def check_backend(backend, specs, *, dtype, block_size, group, head_dim, seed, kv_heads=2):
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=block_size, kv_heads=kv_heads,
                                                group=group, head_dim=head_dim, dtype=dtype,
                                                seed=seed)
    scale = head_dim ** -0.5
    ref_out, ref_k, ref_v = reference(q, k, v, k_cache, v_cache, meta, scale)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale)
    assert_close(out, ref_out, dtype)
    assert torch.equal(k_cache.float(), ref_k) and torch.equal(v_cache.float(), ref_v)
    return out


def decode_specs(rng: random.Random, batch: int, max_len: int, padding: int = 2):
    specs = [(1, rng.randint(1, max_len)) for _ in range(batch)] + [(1, 0)] * padding
    rng.shuffle(specs)
    return specs


def prefill_specs(rng: random.Random, max_len: int, decodes: int = 3):
    """Fresh prompts, prefix hits, chunks after history, and decode rows in one batch (from
    MIXED_MIN_DECODE_ROWS decode rows on, the backend sends them to the decode kernel)."""
    specs = []
    for _ in range(3):
        n = rng.randint(1, max_len)
        specs.append((n, n))
    for _ in range(3):
        n, history = rng.randint(1, max_len), rng.randint(1, max_len)
        specs.append((n, n + history))
    specs += [(1, rng.randint(1, max_len)) for _ in range(decodes)]
    rng.shuffle(specs)
    return specs


KERNEL_CASES = [
    # dtype, block_size, head_dim, group, seed
    (torch.bfloat16, 16, 128, 1, 1),
    (torch.float16, 16, 64, 4, 2),
    (torch.bfloat16, 64, 64, 8, 3),
    (torch.float16, 64, 128, 4, 4),
    (torch.bfloat16, 256, 128, 8, 5),
    (torch.float16, 256, 64, 1, 6),
    (torch.bfloat16, 256, 128, 2, 7),
]


@pytest.mark.parametrize("dtype,block_size,head_dim,group,seed", KERNEL_CASES)
def test_triton_decode_batch_mix(dtype, block_size, head_dim, group, seed):
    rng = random.Random(seed)
    out = check_backend(TritonBackend(), decode_specs(rng, batch=29, max_len=3000), dtype=dtype,
                        block_size=block_size, group=group, head_dim=head_dim, seed=seed)
    assert out.isfinite().all()


@pytest.mark.parametrize("dtype,block_size,head_dim,group,seed", KERNEL_CASES[::2])
@pytest.mark.parametrize("num_splits", [2, 7])
def test_triton_decode_forced_splits(dtype, block_size, head_dim, group, seed, num_splits):
    rng = random.Random(seed + 100)
    specs = decode_specs(rng, batch=5, max_len=2000)
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=block_size, kv_heads=2,
                                                group=group, head_dim=head_dim, dtype=dtype,
                                                seed=seed + 100)
    ref_out, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.1)
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.1,
                       meta.max_seq_len, num_splits=num_splits)
    assert_close(out, ref_out, dtype)
    padding = meta.seq_lens == 0
    assert (out[padding] == 0).all()


@pytest.mark.parametrize("batch,num_splits,kv_cache_dtype", [(256, 1, "auto"), (256, 1, "fp8"), (64, 2, "auto"),
                                                             (3, 5, "fp8")])
def test_longest_first_order_gives_the_same_bits_in_a_graph(batch, num_splits, kv_cache_dtype):
    """The order staged beside the lengths before each replay, as the decode graphs stage it: the
    output is the row order's, bit for bit, replay after replay as the lengths change."""
    rng = random.Random(batch * 100 + num_splits)
    specs = decode_specs(rng, batch=batch, max_len=2048)
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=256, kv_heads=8, group=2, head_dim=128,
                                                dtype=torch.bfloat16, seed=batch + num_splits)
    if kv_cache_dtype == "fp8":
        k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))   # the history too
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    seq_lens = meta.seq_lens.clone()
    run = lambda **kw: paged_decode(q, k_cache, v_cache, seq_lens, meta.block_tables, 0.1, 2048,
                                    num_splits=num_splits, **kw)
    order = longest_first(seq_lens)
    run(seq_order=order)   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(seq_order=order)
    for step in range(20):
        # rows shrink as if finished and refilled: any length up to the ones stored
        seq_lens.copy_((meta.seq_lens - torch.randint_like(meta.seq_lens, 0, 200)).clamp(min=0) if step else meta.seq_lens)
        order.copy_(longest_first(seq_lens))
        graph.replay()
        assert torch.equal(out, run()), step


@pytest.mark.parametrize("split_keys,kv_cache_dtype", [(256, "auto"), (512, "fp8"), (64, "auto")])
def test_fixed_size_splits_match_even_splits_in_a_graph(split_keys, kv_cache_dtype):
    """Splits of split_keys keys, sized for 1,024-key contexts but replayed over contexts up to
    4,096 (the last split takes the rest), against even splits, replay after replay."""
    rng = random.Random(split_keys)
    specs = decode_specs(rng, batch=64, max_len=4096)
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=256, kv_heads=8, group=2, head_dim=128,
                                                dtype=torch.bfloat16, seed=split_keys)
    if kv_cache_dtype == "fp8":
        k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))   # the history too
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    seq_lens = meta.seq_lens.clone()
    run = lambda: paged_decode(q, k_cache, v_cache, seq_lens, meta.block_tables, 0.1, 1024, split_keys=split_keys)
    run()   # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for step in range(10):
        seq_lens.copy_((meta.seq_lens - torch.randint_like(meta.seq_lens, 0, 500)).clamp(min=0) if step else meta.seq_lens)
        graph.replay()
        even = paged_decode(q, k_cache, v_cache, seq_lens, meta.block_tables, 0.1, 4096)
        torch.testing.assert_close(out.float(), even.float(), rtol=1e-2, atol=1e-2)
        assert (out[seq_lens == 0] == 0).all()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("block_size,tiles", [(256, dict(BLOCK_N=64, num_warps=1, num_stages=2)),
                                              (256, dict(BLOCK_N=64, num_warps=1, num_stages=1)),
                                              (256, dict(BLOCK_N=64, num_warps=4, num_stages=3)),
                                              (64, dict(BLOCK_N=32, num_warps=2, num_stages=1)),
                                              (16, dict(BLOCK_N=16, num_warps=1, num_stages=2))])
def test_decode_reading_each_tiles_block_ahead_gives_the_same_bits(kv_cache_dtype, block_size, tiles):
    """Each tile's block read as one index a tile ahead, against the table read per key with the same
    tiles: the same bits, even and fixed-size splits, padding rows included."""
    rng = random.Random(block_size)
    specs = decode_specs(rng, batch=48, max_len=3000)
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=block_size, kv_heads=8, group=2, head_dim=128,
                                                dtype=torch.bfloat16, seed=block_size)
    if kv_cache_dtype == "fp8":
        k_cache, v_cache = (c.to(torch.float8_e4m3fn) for c in (k_cache, v_cache))
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    for split in (dict(num_splits=1), dict(num_splits=5), dict(split_keys=512)):
        run = lambda ahead: paged_decode(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.1, 3000,
                                         config=dict(tiles, BLOCK_AHEAD=ahead), **split)
        want = run(False)
        assert want.isfinite().all() and (want[meta.seq_lens == 0] == 0).all()
        assert torch.equal(run(True), want), split


@pytest.mark.parametrize("block_size", [16, 256])
def test_triton_decode_32k_context_at_batch_1(block_size):
    # Qwen3-0.6B attention: 16 q heads over 8 kv heads, the split-K path fills the GPU
    check_backend(TritonBackend(), [(1, 32768)], dtype=torch.bfloat16, block_size=block_size,
                  group=2, head_dim=128, seed=8, kv_heads=8)


@pytest.mark.parametrize("dtype,block_size,head_dim,group,seed", KERNEL_CASES)
def test_triton_prefill_batch_mix_with_prefix_history(dtype, block_size, head_dim, group, seed):
    rng = random.Random(seed + 200)
    check_backend(TritonBackend(), prefill_specs(rng, max_len=700), dtype=dtype,
                  block_size=block_size, group=group, head_dim=head_dim, seed=seed + 200)


@pytest.mark.parametrize("dtype,block_size,head_dim,group,seed", KERNEL_CASES)
def test_triton_mixed_step_of_many_decode_rows_beside_prompts(dtype, block_size, head_dim, group, seed):
    rng = random.Random(seed + 300)
    check_backend(TritonBackend(), prefill_specs(rng, max_len=700, decodes=150), dtype=dtype,
                  block_size=block_size, group=group, head_dim=head_dim, seed=seed + 300)


def test_triton_prefill_long_prompt_over_long_history():
    check_backend(TritonBackend(), [(3000, 9000), (1, 5000), (1500, 1500)], dtype=torch.bfloat16,
                  block_size=64, group=2, head_dim=128, seed=9, kv_heads=8)


@pytest.mark.parametrize("backend_name,block_size", [("triton", 64), ("flash_attn", 256)])
def test_decode_under_cuda_graph_replay(backend_name, block_size):
    """Capture at max_model_len, then replay over new lengths, tables and padding rows."""
    if backend_name == "flash_attn":
        pytest.importorskip("flash_attn")
    max_model_len, batch = 4096, 8
    rng = random.Random(10)
    specs = decode_specs(rng, batch=batch - 2, max_len=max_model_len)
    max_blocks = max_model_len // block_size
    num_blocks = batch * max_blocks + 4   # the same cache for every step below
    q, k, v, k_cache, v_cache, meta = make_step(specs, block_size=block_size, kv_heads=8,
                                                group=2, head_dim=128, dtype=torch.bfloat16,
                                                seed=10, max_blocks=max_blocks,
                                                num_blocks=num_blocks)
    capture_meta = AttentionMetadata(
        meta.slot_mapping, meta.query_start_loc, meta.seq_lens, meta.block_tables,
        max_query_len=1, max_seq_len=max_model_len, query_lens_host=[], seq_lens_host=[])
    backend = select_backend(backend_name, "cuda", block_size)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):   # compile and warm up outside the capture
        backend.forward(q, k, v, k_cache.clone(), v_cache.clone(), capture_meta, 0.1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, k_cache, v_cache, capture_meta, 0.1)

    for seed in (11, 12):
        rng = random.Random(seed)
        new = make_step(decode_specs(rng, batch=batch - 3, max_len=max_model_len, padding=3),
                        block_size=block_size, kv_heads=8, group=2, head_dim=128,
                        dtype=torch.bfloat16, seed=seed, max_blocks=max_blocks,
                        num_blocks=num_blocks)
        nq, nk, nv, nk_cache, nv_cache, new_meta = new
        for static, fresh in ((q, nq), (k, nk), (v, nv), (k_cache, nk_cache), (v_cache, nv_cache),
                              (meta.slot_mapping, new_meta.slot_mapping),
                              (meta.seq_lens, new_meta.seq_lens),
                              (meta.block_tables, new_meta.block_tables)):
            static.copy_(fresh)
        ref_out, ref_k, _ = reference(q, k, v, k_cache, v_cache, new_meta, 0.1)
        graph.replay()
        real = new_meta.seq_lens > 0
        assert out.isfinite().all()
        assert_close(out[real], ref_out[real], torch.bfloat16)
        assert torch.equal(k_cache.float(), ref_k)
        if backend_name == "triton":
            assert (out[~real] == 0).all()


# flash-attn: the device build is bf16 and head dim 128 only; it pages KV in blocks of 256
@pytest.mark.parametrize("group", [1, 2, 8])
def test_flash_attn_backend_decode_and_prefill(group):
    pytest.importorskip("flash_attn")
    backend = select_backend("flash_attn", "cuda", 256)
    assert backend.name == "flash_attn"
    rng = random.Random(20 + group)
    check_backend(backend, prefill_specs(rng, max_len=1500), dtype=torch.bfloat16,
                  block_size=256, group=group, head_dim=128, seed=20 + group)
    specs = decode_specs(rng, batch=13, max_len=5000, padding=0)
    check_backend(backend, specs, dtype=torch.bfloat16, block_size=256, group=group,
                  head_dim=128, seed=30 + group)


def test_flash_attn_backend_refuses_small_blocks():
    pytest.importorskip("flash_attn")
    with pytest.raises(ValueError, match="multiple of 256"):
        select_backend("flash_attn", "cuda", 16)


def test_auto_picks_flash_attn_only_for_256_blocks():
    expected = "flash_attn"
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        expected = "triton"
    assert select_backend("auto", "cuda", 256).name == expected
    assert select_backend("auto", "cuda", 16).name == "triton"


def test_flash_attn_decode_padding_rows_stay_finite():
    pytest.importorskip("flash_attn")
    backend = select_backend("flash_attn", "cuda", 256)
    q, k, v, k_cache, v_cache, meta = make_step([(1, 300), (1, 0), (1, 1000), (1, 0)],
                                                block_size=256, kv_heads=8, group=2,
                                                head_dim=128, dtype=torch.bfloat16, seed=40)
    ref_out, _, _ = reference(q, k, v, k_cache, v_cache, meta, 0.1)
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.1)
    real = meta.seq_lens > 0
    assert out.isfinite().all()
    assert_close(out[real], ref_out[real], torch.bfloat16)
