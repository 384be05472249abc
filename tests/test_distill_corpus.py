"""What ``tandem distill`` generates from: function openings cut from stdlib sources, held out by file."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

from tandem.tools.distill.corpus import _function_prefixes, code_prefix_prompts, generation_prompt, generation_prompts
from tandem.tools.distill.prose import prose_prompt

BENCH_PROMPTS = Path(__file__).resolve().parent.parent / "tandem" / "data" / "bench_prompts.jsonl"

SOURCE = '''\
import os


def plain(a, b):
    total = a + b
    return total


def documented(path):
    """Read path.

    Returns its text.
    """
    with open(path) as f:
        return f.read()


class Store:
    def __init__(self, root):
        self.root = root
        self.items = {}

    async def fetch(self, key,
                    default=None):
        return self.items.get(key, default)
'''


def test_function_prefixes_keep_the_signature_with_a_docstring_or_a_first_line() -> None:
    prefixes = _function_prefixes(SOURCE)
    assert prefixes == [
        "def plain(a, b):\n",  # no docstring: the signature alone or with one body line, by position
        'def documented(path):\n    """Read path.\n\n    Returns its text.\n    """\n',
        "class Store:\n    def __init__(self, root):\n        self.root = root\n",  # a method keeps its class line
        (
            "class Store:\n    async def fetch(self, key,\n                    default=None):\n"
            "        return self.items.get(key, default)\n"
        ),
    ]
    assert _function_prefixes("def broken(:\n") == []


def test_code_prefix_prompts_are_deterministic_and_held_out_by_file() -> None:
    train = list(itertools.islice(code_prefix_prompts(0, heldout=False), 300))
    assert train == list(itertools.islice(code_prefix_prompts(0, heldout=False), 300))
    assert train != list(itertools.islice(code_prefix_prompts(1, heldout=False), 300))
    heldout = list(itertools.islice(code_prefix_prompts(0, heldout=True), 300))
    assert all(p.lstrip().startswith(("def ", "async def ", "class ")) for p in train + heldout)
    assert len(set(train)) > 250
    assert len(set(train) & set(heldout)) < 15  # only openings common to many files (`def __init__(self):`)


def test_generation_prompts_mix_templates_and_code_prefixes_by_share() -> None:
    templated = list(itertools.islice(generation_prompts(0, False), 200))
    assert templated == list(itertools.islice(generation_prompts(0, False, code_prefix_share=0.0), 200))
    mixed = list(itertools.islice(generation_prompts(0, False, code_prefix_share=0.5), 400))
    code = set(itertools.islice(code_prefix_prompts(0, False), 400))
    assert 120 < sum(p in code for p in mixed) < 280
    assert all(p in code for p in itertools.islice(generation_prompts(0, False, code_prefix_share=1.0), 50))


def test_prose_openings_join_the_mix_by_share_and_leave_the_other_prompts_unchanged_without_it() -> None:
    rng = random.Random(0)
    assert list(itertools.islice(generation_prompts(0, False), 100)) == [generation_prompt(rng, False)
                                                                           for _ in range(100)]
    draw = random.Random(0)  # seed 0's prose stream: prose openings come in its order
    prose = [prose_prompt(draw, False) for _ in range(500)]
    code = set(itertools.islice(code_prefix_prompts(0, False), 500))
    mixed = list(itertools.islice(generation_prompts(0, False, code_prefix_share=0.2, prose_share=0.6), 500))
    assert 60 < sum(p in code for p in mixed) < 140
    in_prose = [p for p in mixed if p not in code and p in set(prose)]
    assert 240 < len(in_prose) < 360
    assert in_prose == prose[: len(in_prose)]
    assert list(itertools.islice(generation_prompts(0, False, prose_share=1.0), 50)) == prose[:50]


def test_prose_openings_are_held_out_by_slot_and_never_the_bench_prompts() -> None:
    train, heldout = (set(prose_prompt(random.Random(seed), held) for seed in range(600)) for held in (False, True))
    assert len(train) > 300 and len(heldout) > 300
    assert len(train & heldout) < 10  # only openings whose slots are all fixed words
    bench = [json.loads(line)["prompt"] for line in BENCH_PROMPTS.read_text().splitlines() if line.strip()]
    assert not any(p.startswith(b) or b.startswith(p) for p in train | heldout for b in bench)
