"""What the target is distilled on: offline text and templated prompts for its own generations.

Nothing here comes from the bench prompt set (the evaluation set): offline text is the Python
standard library's own sources, its pydoc topics and JSON synthesised here; prompts are built from
templates and word lists written for this module. A fixed slice of each source is held out for
measurement (stdlib files by a hash of their path, prompts by drawing their slots from disjoint
halves of the word lists), so held-out agreement is measured on text the head never trained on.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Document:
    """One piece of offline text and where it came from (recorded in the head's metadata)."""

    source: str  # "stdlib", "pydoc", "json"
    text: str


def _heldout_path(path: Path) -> bool:
    """About 1 file in 16 is held out; the choice depends only on the path, so it is stable."""
    return hashlib.sha256(str(path).encode()).digest()[0] < 16


def stdlib_files(heldout: bool) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts and rel.parts[0] in ("site-packages", "dist-packages"):
            continue
        if _heldout_path(rel) == heldout:
            files.append(path)
    return files


def pydoc_topics() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return []
    return [topics[key] for key in sorted(topics)]


_NAMES = ["Ada", "Boris", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ines", "Jonas", "Kiri", "Lena",
          "Mateo", "Nadia", "Oskar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara"]
_CITIES = ["Oslo", "Porto", "Kyoto", "Quito", "Accra", "Perth", "Tunis", "Riga", "Lima", "Hanoi", "Graz", "Cork"]
_WORDS = ["alpha", "beta", "gamma", "delta", "sensor", "widget", "ticket", "invoice", "order", "batch", "queue",
          "report", "node", "edge", "cluster", "shard", "token", "layer", "frame", "packet", "record", "event"]


def synthetic_json(rng: random.Random) -> str:
    """A random but plausible JSON document: records, configs, nested lists, in a few layouts."""

    def value(depth: int) -> object:
        kind = rng.randrange(7 if depth < 3 else 4)
        if kind == 0:
            return rng.randint(-50, 100000)
        if kind == 1:
            return round(rng.uniform(-100, 1000), rng.randint(1, 3))
        if kind == 2:
            return rng.choice([True, False, None])
        if kind == 3:
            return rng.choice(_NAMES + _CITIES + _WORDS) + ("" if rng.random() < 0.6 else f"-{rng.randint(1, 99)}")
        if kind == 4:
            return [value(depth + 1) for _ in range(rng.randint(1, 4))]
        return {rng.choice(_WORDS) + rng.choice(["", "_id", "_name", "_count", "s"]): value(depth + 1)
                for _ in range(rng.randint(1, 5))}

    records = []
    for i in range(rng.randint(2, 8)):
        record = {"id": i + 1, "name": rng.choice(_NAMES), "city": rng.choice(_CITIES),
                  "age": rng.randint(18, 90), "active": rng.random() < 0.7}
        for _ in range(rng.randint(0, 3)):
            record[rng.choice(_WORDS)] = value(1)
        records.append(record)
    doc = {rng.choice(["items", "data", "results", "records", "rows"]): records}
    if rng.random() < 0.5:
        doc["meta"] = {"count": len(records), "page": rng.randint(1, 9), "source": rng.choice(_WORDS)}
    indent = rng.choice([None, 2, 4])
    return json.dumps(doc, indent=indent)


def offline_documents(seed: int, heldout: bool) -> Iterator[Document]:
    """An endless, deterministic mix: mostly stdlib code, some pydoc prose, some JSON."""
    rng = random.Random(seed * 7919 + (1 if heldout else 0))
    files = stdlib_files(heldout)
    topics = [] if heldout else pydoc_topics()
    rng.shuffle(files)
    rng.shuffle(topics)
    fi = ti = 0
    while True:
        roll = rng.random()
        if roll < 0.7 and files:
            path = files[fi % len(files)]
            fi += 1
            try:
                text = path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if text.strip():
                yield Document("stdlib", text)
        elif roll < 0.85 and topics:
            yield Document("pydoc", topics[ti % len(topics)])
            ti += 1
        else:
            yield Document("json", synthetic_json(rng))


# ---- templated generation prompts (raw completion style, like the target sees when serving) ----

_VERBS = ["parse", "count", "merge", "filter", "load", "render", "group", "split", "validate", "normalize",
          "compress", "schedule", "rank", "encode", "flatten", "retry", "summarize", "dedupe", "rotate", "clip"]
_NOUNS = ["lines", "records", "tokens", "events", "intervals", "matrix", "config", "headers", "scores", "words",
          "edges", "prices", "dates", "paths", "users", "samples", "chunks", "labels", "files", "votes"]
_TOPICS = ["volcanoes", "the silk road", "honey bees", "glaciers", "the telegraph", "coral reefs", "bridges",
           "lighthouses", "the immune system", "desert plants", "jazz", "tides", "ancient libraries", "comets",
           "city parks", "paper making", "migratory birds", "the violin", "salt", "railways"]
_QUESTIONS = ["How do I read a file line by line in {lang}?", "What does a hash map do?",
              "Why is the sky darker at dusk?", "Can you explain what recursion is?",
              "How should I name variables in {lang}?", "What is a good way to learn {topic}?",
              "What are the main causes of {topic} changing over time?", "How does a compiler work?",
              "What is the difference between a process and a thread?", "How do I sort a dictionary by value?",
              "What is an HTTP status code?", "Why do programs use logging?"]
_LANGS = ["Python", "JavaScript", "Rust", "Go", "C", "Java"]


def _pick(rng: random.Random, items: list[str], heldout: bool) -> str:
    """Held-out prompts draw from the odd half of a list, training prompts from the even half."""
    return rng.choice(items[1::2] if heldout else items[0::2])


def generation_prompt(rng: random.Random, heldout: bool) -> str:
    verb, noun = _pick(rng, _VERBS, heldout), _pick(rng, _NOUNS, heldout)
    name = f"{verb}_{noun}"
    camel = verb + noun.capitalize()
    topic = _pick(rng, _TOPICS, heldout)
    person, city = _pick(rng, _NAMES, heldout), _pick(rng, _CITIES, heldout)
    a, b = rng.randint(2, 999), rng.randint(2, 99)
    templates = [
        f'def {name}({noun}):\n    """{verb.capitalize()} the given {noun} and return the result."""\n',
        f"def {name}(data, limit=None):\n    result = []\n",
        f"class {camel[0].upper() + camel[1:]}:\n    def __init__(self, {noun}):\n        self.{noun} = {noun}\n\n",
        f"import os\nimport sys\n\n\ndef {name}(path):\n",
        f"function {camel}({noun}) {{\n  const result = [];\n",
        f"const {camel} = async ({noun}) => {{\n",
        f"#include <stdio.h>\n#include <stdlib.h>\n\nint {name}(int *values, int n) {{\n",
        f"fn {name}(items: &[i64]) -> Vec<i64> {{\n",
        f"func {camel[0].upper() + camel[1:]}({noun} []string) map[string]int {{\n",
        f"public static int {camel}(int[] {noun}) {{\n",
        f"-- total {noun} per {verb} step\nSELECT ",
        f"#!/bin/bash\n# {verb} all {noun} in the current directory\n",
        f'{{"name": "{person}", "city": "{city}", "{noun}": [',
        f'The following record describes {person} from {city} as JSON:\n{{\n  "name": "{person}",\n',
        f'[\n  {{"id": {a}, "type": "{noun}", "status": "',
        f"config = {{\n    \"{noun}\": {b},\n",
        f"Q: What is {a} plus {b}?\nA:",
        f"Q: What is {a} times {b}?\nA:",
        f"{a} - {b} = ",
        f"Problem: {person} buys {b} {noun} at {a} cents each. How much does {person} pay in total?\nAnswer:",
        (f"Problem: A tank holds {a} liters and loses {b} liters per hour. After how many hours is it empty?\n"
        "Answer:"),
        (f"User: {_pick(rng, _QUESTIONS, heldout).format(lang=_pick(rng, _LANGS, heldout), topic=topic)}\n"
        "Assistant:"),
        f"Q: {_pick(rng, _QUESTIONS, heldout).format(lang=_pick(rng, _LANGS, heldout), topic=topic)}\nA:",
        f"A short essay on {topic}.\n\n",
        f"Most people have never thought much about {topic}, but",
        f"{person} arrived in {city} late in the evening and",
        f"Chapter {b}\n\nThe {noun} had been",
        f"Here are five facts about {topic}:\n1.",
    ]
    return rng.choice(templates)


# ---- code prefixes cut from the standard library (the target continues real code, as when serving) ----

_MAX_PREFIX_LINES = 14


def _function_prefixes(text: str) -> list[str]:
    """Every function's opening in one source file: its signature, and its docstring or first body lines.

    A method keeps its class line above it, so the target sees the indentation it would in a file.
    Templated prompts cover a few dozen shapes; these cover thousands of real ones, which is what a
    head needs to agree with the target on code it has not seen.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    prefixes = []

    def visit(node: ast.AST, owner: str | None) -> None:  # module-level functions and classes' methods
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and owner is None:
                visit(child, lines[child.lineno - 1])
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and child.body:
                first = child.body[0]
                has_doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str)
                # with no docstring: the signature alone, or one body line too (alternating by position)
                end = first.end_lineno if has_doc else first.lineno - 1 + child.lineno % 2
                start = child.lineno  # the def line (decorators left out)
                if end is None or end - start + 1 > _MAX_PREFIX_LINES:
                    end = first.lineno - 1  # only the signature
                body = lines[start - 1 : end]
                if not body or end - start + 1 > _MAX_PREFIX_LINES:
                    continue
                head = [owner] if owner is not None else []
                prefixes.append("\n".join(head + body) + "\n")

    visit(tree, None)
    return prefixes


def code_prefix_prompts(seed: int, heldout: bool) -> Iterator[str]:
    """An endless, deterministic stream of function openings from stdlib files (held out by path)."""
    rng = random.Random(seed * 15485863 + (1 if heldout else 0))
    files = [f for f in stdlib_files(heldout) if not {"test", "tests", "idle_test"} & set(f.parts)]
    rng.shuffle(files)
    index = 0
    while files:
        path = files[index % len(files)]
        index += 1
        try:
            prefixes = _function_prefixes(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        rng.shuffle(prefixes)
        yield from prefixes[:4]  # a few per file, so a time budget still sees many files


def generation_prompts(seed: int, heldout: bool, code_prefix_share: float = 0.0,
                       prose_share: float = 0.0) -> Iterator[str]:
    """Templated prompts; ``code_prefix_share`` of them stdlib function openings, ``prose_share`` prose openings.

    The prose openings draw from their own generator, so adding them leaves the other prompts' stream
    (and so earlier caches and held-out sets) unchanged wherever ``prose_share`` is 0.
    """
    from tandem.tools.distill.prose import prose_prompt  # prose.py draws its slots with _pick below

    rng = random.Random(seed * 104729 + (1 if heldout else 0))
    prose_rng = random.Random(seed * 1299709 + (1 if heldout else 0))
    code = code_prefix_prompts(seed, heldout) if code_prefix_share > 0 else None
    while True:
        roll = rng.random() if code is not None or prose_share > 0 else 1.0
        if code is not None and roll < code_prefix_share:
            yield next(code)
        elif roll < code_prefix_share + prose_share:
            yield prose_prompt(prose_rng, heldout)
        else:
            yield generation_prompt(rng, heldout)
