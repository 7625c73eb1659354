"""The vocabulary-split embedding and LM head over two gloo ranks equal the whole-vocabulary layers,
for a vocabulary that does not split evenly (the last rank's slice is padded)."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

VOCAB, DIM = 11, 6
pytestmark = pytest.mark.timeout(300)


def _rank(rank: int, init_method: str, results) -> None:
    import torch.distributed as dist

    from nanoserve.runner.layers.vocab import ParallelLMHead, VocabParallelEmbedding
    from nanoserve.runner.parallel import init_process_group

    tp = init_process_group(rank, 2, init_method, "cpu")
    table = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0))
    embed, head = VocabParallelEmbedding(VOCAB, DIM, tp), ParallelLMHead(VOCAB, DIM, tp)
    for layer in (embed, head):
        layer.weight.weight_loader(layer.weight, table)
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    hidden = torch.randn(4, DIM, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():  # as the runner calls them
        results.put((rank, embed.weight.shape[0],
                     torch.allclose(embed(ids), table[ids]),
                     torch.allclose(head(hidden), hidden @ table.T, atol=1e-6)))
    dist.destroy_process_group()


def test_two_rank_vocab_split_equals_the_whole_layers(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    init_method = f"file://{tmp_path / 'rendezvous'}"
    ranks = [context.Process(target=_rank, args=(r, init_method, results)) for r in range(2)]
    for p in ranks:
        p.start()
    got = sorted(results.get(timeout=60) for _ in ranks)
    for p in ranks:
        p.join(timeout=60)
    assert got == [(0, 6, True, True), (1, 6, True, True)]
