"""Numeric fields have bounds the sampler's tensors can hold, and tiny floats never empty a completion."""

from __future__ import annotations

import threading

import httpx
import pytest

from nanoserve import SamplingParams
from tests.server.conftest import ServerProcess

INT64_OVER = 2**63  # one past int64: torch.tensor([...], dtype=int64) raises on it
BASE = {"model": "tiny", "prompt": "A list is a sequence of", "max_tokens": 8}


@pytest.fixture(scope="module")
def server(server_model, tmp_path_factory):
    with ServerProcess(server_model, tmp_path_factory.mktemp("bounds"), "--num-kvcache-blocks", "128",
                       "--block-size", "16", "--max-num-seqs", "8") as proc:
        yield proc


def post(server: ServerProcess, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={**BASE, **body}, timeout=60)


def test_a_huge_top_k_beside_a_small_one_does_not_kill_the_engine(server):
    # request A samples with top_k 5 for a while; B, with a top_k past int64, joins its batch
    long_run: list[httpx.Response] = []
    a = threading.Thread(target=lambda: long_run.append(post(server, max_tokens=200, top_k=5, ignore_eos=True)))
    a.start()
    b = post(server, top_k=INT64_OVER)
    a.join(120)
    assert b.status_code == 400 and b.json()["error"]["param"] == "top_k", b.text
    assert long_run[0].status_code == 200, long_run[0].text
    # within the int32 bound any top_k is served, in a batch with others, and the engine lives on
    bounded = threading.Thread(target=lambda: long_run.append(post(server, max_tokens=100, top_k=5, ignore_eos=True)))
    bounded.start()
    big = post(server, top_k=2**31 - 1)
    bounded.join(120)
    assert big.status_code == 200 and long_run[1].status_code == 200, (big.text, long_run[1].text)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert post(server).status_code == 200


@pytest.mark.parametrize("field, value", [
    ("top_k", INT64_OVER), ("top_k", 2**31), ("seed", 2**64), ("seed", -(2**63) - 1), ("min_tokens", 2**31),
    ("max_tokens", 2**31), ("truncate_prompt_tokens", 2**31), ("n", 2**63), ("logprobs", 2**63),
    ("stop_token_ids", [INT64_OVER]), ("repetition_penalty", 1e-300), ("repetition_penalty", 1e-30),
])
def test_out_of_range_numbers_get_a_400_naming_the_field(server, field, value):
    r = post(server, **{field: value})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"], error


@pytest.mark.parametrize("bias, words", [
    ({str(INT64_OVER): 1}, "out of range"), ({"1" * 5000: 1}, "out of range"), ({"²": 1}, "token id"),
    ({"5": 1e-300}, None), ({"5": -100.5}, "100"),
])
def test_logit_bias_keys_and_values_are_bounded(server, bias, words):
    r = post(server, logit_bias=bias, temperature=0)
    if words is None:  # a tiny bias is a bias of nothing, not an error
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias" and words in r.json()["error"]["message"]


def greedy(server: ServerProcess) -> str:
    r = post(server, temperature=0, ignore_eos=True)
    assert r.status_code == 200
    return r.json()["choices"][0]["text"]


@pytest.mark.parametrize("tiny", [1e-300, 1e-30, 1e-6])
def test_a_temperature_below_epsilon_is_greedy(server, tiny):
    r = post(server, temperature=tiny, ignore_eos=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"] == greedy(server)


@pytest.mark.parametrize("field", ["top_p", "presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("tiny", [1e-300, 1e-30])
def test_underflowing_filters_and_penalties_never_empty_the_text(server, field, tiny):
    # top_p that small keeps only the most likely token: greedy; a penalty that small is none
    r = post(server, **{field: tiny}, temperature=1e-3 if field == "top_p" else 0, ignore_eos=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"] == greedy(server)


def test_sampling_params_refuse_what_the_sampler_cannot_hold():
    for kwargs in ({"top_k": 2**31}, {"seed": 2**64}, {"min_tokens": 2**31}, {"max_tokens": 2**31},
                   {"repetition_penalty": 1e-300}, {"temperature": float("inf")}, {"top_p": float("nan")},
                   {"logit_bias": {2**31: 1.0}}, {"logit_bias": {1: float("nan")}}, {"stop_token_ids": [2**63]}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)
    assert SamplingParams(temperature=1e-300).greedy
    assert not SamplingParams(presence_penalty=1e-300, frequency_penalty=-1e-300).uses_penalties
