import pytest
import torch

from nanoserve.runner.attention import decode_tiles
from nanoserve.runner.attention.decode_tiles import decode_config

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.fixture
def asked(monkeypatch):
    def ask(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        decode_tiles.tiles_asked.cache_clear()
    yield ask
    decode_tiles.tiles_asked.cache_clear()


def test_asked_tiles_replace_the_defaults_of_their_cache_kind_only(asked):
    default_fp8, default_bf16 = decode_config(CUDA, fp8=True), decode_config(CUDA, fp8=False)
    asked(NANOSERVE_DECODE_TILES_FP8="256,8,3")
    fp8 = decode_config(CUDA, fp8=True)
    assert (fp8["BLOCK_N"], fp8["num_warps"], fp8["num_stages"]) == (256, 8, 3)
    assert fp8["BLOCK_AHEAD"] == default_fp8["BLOCK_AHEAD"]   # keys the switch does not name stay
    assert decode_config(CUDA, fp8=False) == default_bf16


def test_the_interpreters_small_tiles_ignore_the_switch(asked):
    asked(NANOSERVE_DECODE_TILES_BF16="128,4,2")
    assert decode_config(CPU)["BLOCK_N"] == 16
    assert decode_config(CUDA)["BLOCK_N"] == 128


def test_a_register_cap_may_follow_the_tiles(asked):
    asked(NANOSERVE_DECODE_TILES_FP8="128,4,2,128")
    tiles = decode_config(CUDA, fp8=True)
    assert (tiles["BLOCK_N"], tiles["num_warps"], tiles["num_stages"], tiles["maxnreg"]) == (128, 4, 2, 128)
    assert "maxnreg" not in decode_config(CUDA, fp8=False)
