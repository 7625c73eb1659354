"""json_depth, which bounds how deep schemas and replayed tool-call arguments nest: the same depth
as a walk over the brackets outside strings, and no Python step per bracket (a request may carry
tens of megabytes of them, and the check holds the interpreter lock while it runs)."""

from __future__ import annotations

import itertools
import random
import re
import time

from nanoserve.structured_outputs_params import JSON_STRING, json_depth


def walked_depth(text: str) -> int:
    brackets = re.findall(r"[\[\]{}]", re.sub(JSON_STRING, "", text))
    return max(0, max(itertools.accumulate(1 if b in "[{" else -1 for b in brackets), default=0))


def test_the_depth_is_that_of_a_walk_over_the_brackets_outside_strings() -> None:
    rng = random.Random(0)
    alphabet = '[]{}"\\ax,:1é\U0001f600\ud800'   # escapes, non-ASCII and a lone surrogate among them
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert json_depth(text) == walked_depth(text), text
    assert json_depth('{"a": [{"b": "[[[["}], "c": {}}') == 3
    assert json_depth("[" * 300 + "]" * 300) == 300
    assert json_depth("no brackets") == json_depth("") == json_depth("]]]") == 0


def test_thirty_megabytes_of_brackets_are_measured_in_well_under_a_second_or_two() -> None:
    # a per-bracket walk took 7.5 s here, holding every stream of the server
    start = time.process_time()
    assert json_depth("[]" * (15 << 20)) == 1
    assert json_depth("[" * (1 << 20) + "]" * (1 << 20)) == 1 << 20
    assert time.process_time() - start < 3.0
