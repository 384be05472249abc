"""Drafts guided by a constrained session's grammar (draft_service.guide): forced text proposed as
the target will have to take it, the drafter's proposals cut where the grammar refuses them, and
the matcher kept in step with commits that roll back (blocks sent ahead)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from draft_service.guide import SOURCE, GrammarGuide, GuidedSession
from draft_service.proposers.base import ProposerSession
from draft_service.types import Proposal, SamplingParams, SessionSpec, SparseDist, TargetInfo
from tandem.grammar import GrammarCompiler
from tandem.models import load_tokenizer, tokenizer_fingerprint
from tandem.rpc.types import Grammar, GrammarKind

SCHEMA = Grammar(GrammarKind.JSON_SCHEMA, json.dumps({
    "type": "object", "properties": {"name": {"type": "string"}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"], "additionalProperties": False}))


class Scripted(ProposerSession):
    """Proposes what it is told; records commits."""

    def __init__(self) -> None:
        self.next = Proposal()
        self.commits: list[tuple[int, list[int]]] = []

    def propose(self, max_tokens: int) -> Proposal:
        return self.next

    def commit(self, base_len: int, token_ids: Sequence[int], hidden_states=None) -> None:
        self.commits.append((base_len, list(token_ids)))

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return load_tokenizer(str(tiny_dir))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def guided(compiler, tokenizer, prompt: list[int], generated: list[int] = ()) -> tuple[GuidedSession, Scripted]:
    inner = Scripted()
    encode = lambda text: ids(tokenizer, text)  # noqa: E731
    return GuidedSession(inner, compiler.matcher(SCHEMA, ()), encode, len(prompt), prompt + list(generated)), inner


def test_forced_text_is_proposed_as_the_tokenizer_spells_it(compiler, tokenizer) -> None:
    session, inner = guided(compiler, tokenizer, [5, 6, 7])
    inner.next = Proposal(token_ids=tuple(ids(tokenizer, "hello")))  # never asked: the text is forced
    proposal = session.propose(16)
    assert tokenizer.decode(proposal.token_ids) == '{"name": "'
    assert proposal.sources == (SOURCE,) * len(proposal.token_ids) and not proposal.probs
    assert len(session.propose(2).token_ids) == 2  # as many as asked for


def test_a_chain_is_cut_at_its_first_forbidden_token_and_followed_by_the_forced_text(compiler, tokenizer) -> None:
    start = ids(tokenizer, '{"name": "')
    session, inner = guided(compiler, tokenizer, [5], start)
    good = ids(tokenizer, 'ab"')
    bad = ids(tokenizer, "}")  # a string ends with ", then comes the next key: } is refused
    chain = (*good, *bad, *ids(tokenizer, "x"))
    inner.next = Proposal(token_ids=chain, probs=tuple(SparseDist((t,), (1.0,)) for t in chain),
                          sources=("head:0.9",) * len(chain))
    proposal = session.propose(16)
    n = len(good)
    assert proposal.token_ids[:n] == tuple(good) and tokenizer.decode(proposal.token_ids[n:]) == ', "ok": '
    assert proposal.sources == ("head:0.9",) * n + (SOURCE,) * (len(proposal.token_ids) - n)
    assert [q.token_ids for q in proposal.probs] == [(t,) for t in proposal.token_ids]  # forced: q certain
    assert len(session.propose(n + 1).token_ids) == n + 1  # no more than asked for
    inner.next = Proposal(token_ids=tuple(ids(tokenizer, "ab")))
    assert session.propose(8) is inner.next  # nothing refused, nothing forced after it: as it was


def test_a_tree_loses_its_forbidden_nodes_and_gains_the_forced_text_under_its_leaves(compiler, tokenizer) -> None:
    session, inner = guided(compiler, tokenizer, [5], ids(tokenizer, '{"name": "'))
    a, quote, newline, b = (ids(tokenizer, s)[0] for s in ("a", '"', "\n", "b"))
    #  root -> a -> quote -> newline (refused: after '"a"' comes ", ")
    #       -> newline (refused: no raw control character in a JSON string) -> b (its subtree)
    #       -> b
    inner.next = Proposal(token_ids=(a, quote, newline, newline, b, b), parents=(-1, 0, 1, -1, 3, -1),
                          sources=("s0", "s1", "s2", "s3", "s4", "s5"))
    proposal = session.propose(16)
    assert proposal.token_ids[:3] == (a, quote, b) and proposal.parents[:3] == (-1, 0, -1)
    assert proposal.sources[:3] == ("s0", "s1", "s5")
    # Under the leaf '"a"' the text the grammar forces, as a chain (under "b", still in the string: none).
    forced = proposal.token_ids[3:]
    assert tokenizer.decode(forced) == ', "ok": ' and proposal.sources[3:] == (SOURCE,) * len(forced)
    assert proposal.parents[3:] == (1, *range(3, 3 + len(forced) - 1))
    assert len(session.propose(4).token_ids) == 4  # never more drafts than asked for, nodes of a tree included


def test_commits_that_roll_back_keep_the_matcher_in_step(compiler, tokenizer) -> None:
    """A pipelined loop commits assumed tokens and later a verdict from an earlier base: the
    session then proposes what a session made fresh on the final tokens proposes."""
    prompt = [5, 6]
    text = ids(tokenizer, '{"name": "ab", "ok": true}')
    session, inner = guided(compiler, tokenizer, prompt)
    session.commit(2, text[:4])
    refused = ids(tokenizer, "\n")[0]  # no raw control character in a JSON string
    session.commit(6, [refused])  # an assumed guess the grammar refuses: guidance pauses
    inner.next = Proposal(token_ids=(9, 9))
    assert session.propose(4) is inner.next
    session.commit(2 + 3, text[3:6])  # the verdict: from an earlier base, other tokens
    fresh, _ = guided(compiler, tokenizer, prompt, text[:6])
    assert session.propose(8) == fresh.propose(8)
    assert inner.commits == [(2, text[:4]), (6, [refused]), (5, text[3:6])]


def spec(token_ids: Sequence[int], prompt_len: int, grammar: Grammar | None) -> SessionSpec:
    return SessionSpec("s", tuple(token_ids), prompt_len, SamplingParams(), 4, grammar=grammar)


def test_the_guide_loads_in_the_background_and_wraps_only_constrained_sessions(tiny_dir, tokenizer) -> None:
    target = TargetInfo("tiny", len(tokenizer), tokenizer_fingerprint(tokenizer),
                        eos_token_ids=(tokenizer.eos_token_id,))
    guide = GrammarGuide(str(tiny_dir), target)
    inner = Scripted()
    # Not loaded yet: unguided, while the tokenizer loads and the grammar compiles in the background.
    assert guide.wrap(inner, spec([5, 6], 2, SCHEMA)) is inner
    deadline = time.monotonic() + 60
    while guide.wrap(inner, spec([5, 6], 2, SCHEMA)) is inner and time.monotonic() < deadline:
        time.sleep(0.05)
    assert guide.ready and isinstance(guide.wrap(inner, spec([5, 6], 2, SCHEMA)), GuidedSession)
    assert guide.wrap(inner, spec([5, 6], 2, None)) is inner
    other = Grammar(GrammarKind.REGEX, "(yes|no)")  # a grammar seen for the first time: unguided until compiled
    assert guide.wrap(inner, spec([5, 6], 2, other)) is inner
    bad = Grammar(GrammarKind.REGEX, "(open")  # one that does not compile: unguided for good
    for _ in range(3):
        assert guide.wrap(inner, spec([5], 1, bad)) is inner
        time.sleep(0.2)
    # A session moved to this target with its text so far: the grammar starts at the matched tokens.
    text = ids(tokenizer, '{"name": "ab", ')
    moved = dataclasses.replace(spec([5, 6, *text], 2 + len(text), SCHEMA), continued_tokens=len(text))
    wrapped = guide.wrap(inner, moved)
    assert tokenizer.decode(wrapped.propose(8).token_ids) == '"ok": '


def test_a_guide_started_before_its_target_is_known_builds_once_attached(tiny_dir, tokenizer, tmp_path,
                                                                          monkeypatch) -> None:
    """As the service starts it: the tokenizer's facts and the forced-text encoder load before the
    draft waits for its target; the compiler is built in the background once the target's facts
    come. Once the target's records exist (its tokenizer's facts, the grammar table), a guide loads
    no transformers tokenizer at all."""
    from tandem.models import loading

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    target = TargetInfo("tiny", len(tokenizer), tokenizer_fingerprint(tokenizer),
                        eos_token_ids=(tokenizer.eos_token_id,))
    for attempt in ("records made", "records read"):
        guide = GrammarGuide(str(tiny_dir))
        guide.load()
        guide.start()  # (loaded already: nothing more)
        assert not guide.ready  # nothing to build for yet
        guide.attach(target)
        inner = Scripted()
        deadline = time.monotonic() + 60
        while guide.wrap(inner, spec([5, 6], 2, SCHEMA)) is inner and time.monotonic() < deadline:
            time.sleep(0.05)
        session = guide.wrap(inner, spec([5, 6], 2, SCHEMA))
        assert isinstance(session, GuidedSession), attempt
        assert tokenizer.decode(session.propose(16).token_ids) == '{"name": "'
        monkeypatch.setattr(loading, "load_tokenizer", lambda *_: pytest.fail("the tokenizer was loaded"))


def test_forced_text_is_encoded_as_the_tokenizer_encodes_it(tiny_dir, tokenizer, tmp_path) -> None:
    """From ``tokenizer.json`` alone, or through the tokenizer where a checkpoint has no such file."""
    import shutil

    from draft_service.guide import forced_text_encoder
    from tandem.models.tokenizer_facts import TokenizerLoader

    texts = ['{"name": "', '", "ok": ', "true}", " spaced  out\n\ttabs", "ünïcödé 🤖", ""]
    encode = forced_text_encoder(TokenizerLoader(tiny_dir))
    assert [list(encode(t)) for t in texts] == [ids(tokenizer, t) for t in texts]
    copy = tmp_path / "no-tokenizer-json"
    shutil.copytree(tiny_dir, copy)
    (copy / "tokenizer.json").unlink()
    loader = TokenizerLoader(copy, tokenizer=tokenizer)
    assert [list(forced_text_encoder(loader)(t)) for t in texts] == [ids(tokenizer, t) for t in texts]


def test_a_tokenizer_that_is_not_the_targets_leaves_sessions_unguided(tiny_dir, tokenizer) -> None:
    target = TargetInfo("other", len(tokenizer), "another-fingerprint", eos_token_ids=(tokenizer.eos_token_id,))
    guide = GrammarGuide(str(tiny_dir), target)
    inner = Scripted()
    guide.wrap(inner, spec([5], 1, SCHEMA))
    time.sleep(1.0)
    assert not guide.ready and guide.wrap(inner, spec([5], 1, SCHEMA)) is inner


def test_a_draft_that_stops_does_not_wait_for_its_guide_to_load(tiny_dir, tokenizer) -> None:
    """The guide loads on a daemon thread: a process told to stop while the tokenizer still loads
    (seconds for a large vocabulary) exits without waiting for it. Here the load never ends."""
    script = f"""
import threading
from draft_service import guide as module
from draft_service.types import TargetInfo
released = threading.Event()
module.GrammarGuide._load = lambda self: released.wait()
guide = module.GrammarGuide({str(tiny_dir)!r}, TargetInfo("tiny", 8, "f", eos_token_ids=(1,)))
guide.start()
(worker,) = [t for t in threading.enumerate() if t.name == "grammar-guide"]
print("daemon" if worker.daemon else "joined at exit", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "daemon"), done.stderr


async def test_the_engine_guides_constrained_sessions_it_drafts(tiny_dir, tokenizer) -> None:
    """Through DraftEngine.speculate: a constrained session's first block is the text its grammar
    forces; an unconstrained one's is the drafter's."""
    from contextlib import aclosing

    from draft_fakes import ReferenceTarget, load_tiny
    from test_draft_parking import Port

    from draft_service.engine import DraftEngine
    from draft_service.proposers.ngram import NgramProposer
    from tandem.models.worker import ModelWorker
    from tandem.telemetry.metrics import make_metrics

    target = TargetInfo("tiny", len(tokenizer), tokenizer_fingerprint(tokenizer),
                        eos_token_ids=(tokenizer.eos_token_id,))
    guide = GrammarGuide(str(tiny_dir), target)
    inner = Scripted()
    deadline = time.monotonic() + 60
    while guide.wrap(inner, spec([5], 1, SCHEMA)) is inner and time.monotonic() < deadline:
        time.sleep(0.05)  # loaded and SCHEMA compiled
    port = Port(ReferenceTarget(load_tiny(tiny_dir).model))
    engine = DraftEngine(NgramProposer(), port, target, ModelWorker("test-guide"), make_metrics("draft"), default_k=8,
                         guide=guide)
    prompt = tuple(ids(tokenizer, "Give me JSON: "))
    for session_id, grammar in (("free", None), ("json", SCHEMA)):
        port.verifier.target.prefill(session_id, prompt, max_new_tokens=12)
        committed = port.verifier.target.sessions[session_id].tokens
        committed[-1] = ids(tokenizer, "{")[0]  # (this reference target is unconstrained: a first token JSON allows)
        tokens = tuple(committed)
        session = SessionSpec(session_id, tokens, len(prompt), SamplingParams(), 8, max_new_tokens=2, grammar=grammar)
        async with aclosing(engine.speculate(session)) as rounds:
            [r async for r in rounds]
    first = {block.session_id: block.proposal for block in reversed(port.verifier.blocks)}  # each one's first
    assert set(first["json"].sources) == {SOURCE}
    assert tokenizer.decode(first["json"].token_ids) == '"name": "'
    assert SOURCE not in first["free"].sources


def test_the_default_targets_forced_text_is_encoded_as_its_tokenizer_encodes_it() -> None:
    """gemma-3-270m's tokenizer class rebuilds its backend from the vocabulary; its tokenizer.json
    spells text the same: JSON's punctuation and keys, and the bench's prompts."""
    from draft_service.guide import forced_text_encoder
    from tandem.models import resolve
    from tandem.models.tokenizer_facts import TokenizerLoader

    loader = TokenizerLoader(resolve("gemma-3-270m").hf_dir)
    encode, tokenizer = forced_text_encoder(loader), loader.get()
    bench = Path(__file__).resolve().parents[1] / "tandem" / "data" / "bench_prompts.jsonl"
    texts = ['{"name": "', '", "age": ', ', "tags": ["', '"]}', "\n  ", "<end_of_turn>"]
    texts += [json.loads(line)["prompt"] for line in bench.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert [list(encode(t)) for t in texts] == [ids(tokenizer, t) for t in texts]
