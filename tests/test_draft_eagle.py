"""The eagle proposer (a feature-conditioned head on the target's hidden states) and the
reduced-vocabulary ``hf`` draft.

Heads here are randomly initialised (``save_head`` into temp dirs) for tiny random targets: what is
tested is the plumbing and exactness, not acceptance. Greedy output must equal transformers' own
``generate()``; the first block of a fresh session is empty and brings the first feature.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from draft_fakes import InMemoryVerifier, ReferenceTarget, generate_greedy, load_tiny

from draft_service import wire
from draft_service.block_length import PriorFileError, save_prior
from draft_service.errors import IncompatibleDraftError
from draft_service.loop import SpeculationLoop
from draft_service.main import start_draft
from draft_service.pipeline import PipelinedLoop
from draft_service.proposers import eagle_head_dir, make_proposer
from draft_service.proposers.eagle import EagleProposer, EagleSession, check_head_fits_target
from draft_service.proposers.hf import VOCAB_IDS_FILE, HfProposer
from draft_service.types import FinishReason, Proposal, ProposedBlock, SamplingParams, SessionSpec, TargetInfo
from tandem.config import DraftSettings
from tandem.models import ModelSpecError, is_eagle_draft, load_model, tokenizer_fingerprint
from tandem.models import eagle as eagle_module
from tandem.models.eagle import EagleConfig, EagleHead, load_head, save_head
from tandem.quant.checkpoint import BLOCKS_FILE, cached_embedding, write_blocks
from tandem.quant.modules import QuantLinear
from tandem.quant.reference import dequantize
from tandem.quant.tensor import QuantizedTensor
from tandem.quant.native import QuantKernel, probe
from tandem.rpc import codecs
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from target_service import wire as target_wire
from target_service.engine import TargetEngine
from target_service.main import start_target
from target_service.session import SessionConfig

PROMPT = (2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52)
VOCAB = 300
REDUCED = 120


# --------------------------------------------------------------------------- fixtures and helpers


def make_head(folder: Path, loaded, seed: int = 0, reduced: int = REDUCED, **overrides) -> Path:
    """A random head for ``loaded`` (a tiny target) saved as a head directory."""
    text = loaded.model.config.get_text_config()
    tied = bool(getattr(loaded.model.config, "tie_word_embeddings", False))
    fields = {
        "hidden_size": int(text.hidden_size),
        "inner_size": 64,
        "num_layers": 2,
        "reduced_vocab_size": reduced,
        "target_vocab_size": int(text.vocab_size),
        "target_model": str(loaded.hf_dir),
        "target_fingerprint": tokenizer_fingerprint(loaded.tokenizer),
        "head_tensor": "model.embed_tokens.weight" if tied else "lm_head.weight",
    }
    fields.update(overrides)
    torch.manual_seed(seed)
    head = EagleHead(EagleConfig(**fields))
    # Reduced ids in a shuffled order, so a missing reduced -> target mapping would show.
    vocab_ids = torch.randperm(fields["target_vocab_size"], generator=torch.Generator().manual_seed(seed))[:reduced]
    save_head(folder, head, vocab_ids)
    return folder


def target_info(loaded, **overrides) -> TargetInfo:
    text = loaded.model.config.get_text_config()
    fields = {
        "model_name": loaded.name,
        "vocab_size": int(text.vocab_size),
        "tokenizer_fingerprint": tokenizer_fingerprint(loaded.tokenizer),
        "max_context_len": 2048,
        "eos_token_ids": (loaded.tokenizer.eos_token_id,),
        "hidden_size": int(text.hidden_size),
    }
    fields.update(overrides)
    return TargetInfo(**fields)


def load_eagle(head_dir: Path, loaded, **kwargs) -> EagleProposer:
    return EagleProposer.load(head_dir, loaded.hf_dir, target_info(loaded), **kwargs)


@pytest.fixture(scope="module")
def llama(tiny_dir):
    return load_tiny(tiny_dir)


@pytest.fixture(scope="module")
def gemma(tiny_gemma_dir):
    return load_tiny(tiny_gemma_dir)


@pytest.fixture(params=["llama", "gemma3"])
def target(request, llama, gemma):
    return llama if request.param == "llama" else gemma


@pytest.fixture(scope="module")
def llama_head(llama, tmp_path_factory) -> Path:
    return make_head(tmp_path_factory.mktemp("llama-head"), llama)


@pytest.fixture
def head_dir(target, tmp_path) -> Path:
    return make_head(tmp_path / "head", target)


class EngineVerifier:
    """The loop's BlockVerifier over an in-process TargetEngine, through the real wire conversion
    (so hidden states travel as fp16 bytes, as over gRPC)."""

    def __init__(self, engine: TargetEngine) -> None:
        self.engine = engine
        self.blocks: list[ProposedBlock] = []
        self._answers: list = []  # verdicts of blocks sent and not received yet, oldest first

    async def verify(self, block: ProposedBlock):
        await self.send(block)
        return await self.receive(block.block_id)

    async def send(self, block: ProposedBlock) -> None:
        """Judged at once, in order (what the target does with a stream's blocks)."""
        self.blocks.append(block)
        verdict = self.engine.verify(block.block())
        self._answers.append(wire.verdict_from_response(target_wire.verify_response(verdict)))

    async def receive(self, block_id: int):
        verdict = self._answers.pop(0)
        assert verdict.block_id == block_id, (verdict.block_id, block_id)
        return verdict


async def run_inline(fn, *args):
    return fn(*args)


async def speculate_in_process(loaded, proposer, n: int, k: int = 4, depth: int = 1, **sampling):
    """Prefills a session in a TargetEngine and runs the speculation loop to its end (the
    pipelined loop with ``depth`` blocks in flight when depth > 1)."""
    engine = TargetEngine(loaded)
    first = engine.prefill("s", PROMPT, SessionConfig(max_new_tokens=n, **sampling))
    committed = (*PROMPT, first.token_id)
    sampling_config = SamplingParams(**sampling)
    spec = SessionSpec("s", committed, len(PROMPT), sampling_config, k, session_max_new_tokens=n)
    verifier = EngineVerifier(engine)
    loop = (PipelinedLoop if depth > 1 else SpeculationLoop)(
        spec, proposer.new_session(committed, sampling_config), verifier, run_inline,
        want_hidden_states=proposer.wants_hidden_states, shapes=proposer.shapes_for(sampling_config),
        **({"depth": depth} if depth > 1 else {}),
    )
    results = [r async for r in loop.rounds()]
    tokens = [first.token_id, *(t for r in results for t in r.token_ids)]
    return tokens, results, verifier.blocks


# --------------------------------------------------------------------------- greedy losslessness


async def test_greedy_eagle_loop_equals_the_targets_generate(target, head_dir):
    n = 24
    proposer = load_eagle(head_dir, target)
    tokens, results, blocks = await speculate_in_process(target, proposer, n)
    assert tokens == generate_greedy(target.model, PROMPT, n, target.tokenizer.eos_token_id)
    assert results[-1].finish_reason in (FinishReason.LENGTH, FinishReason.STOP)
    # The fresh session has no feature: its first block is empty and brings one; the rest draft.
    assert len(blocks[0].proposal.token_ids) == 0
    assert all(b.return_hidden_states for b in blocks)
    assert all(len(b.proposal.token_ids) > 0 for b in blocks[1:-1])
    vocab_ids = set(proposer.drafter.vocab_ids.tolist())
    assert all(t in vocab_ids for b in blocks for t in b.proposal.token_ids)
    # Each block's first draft is one step from the target's feature at position base_len - 2 (the
    # one whose logits produced the last committed token) and the last committed token: the
    # convention the head is trained with.
    sequence = [*PROMPT, *tokens]
    with torch.inference_mode():
        features = target.model(torch.tensor([sequence]), output_hidden_states=True).hidden_states[-1][0]
    features = features.half().float()  # [len, hidden], as on the wire
    agree = drafted = 0
    for block in blocks:
        if block.proposal.token_ids:
            at = block.base_len
            _, logits = proposer.drafter.step(features[at - 2 : at - 1], torch.tensor([sequence[at - 1]]))
            drafted += 1
            agree += int(proposer.drafter.vocab_ids[logits[0].argmax()]) == block.proposal.token_ids[0]
    assert drafted > 0 and agree >= drafted - 1  # (a near-tie may flip under rounding)


async def test_eagle_draft_service_over_grpc(llama, llama_head, tmp_path):
    """The draft service with an eagle proposer, in front of the real target service: the gateway
    prefills without hidden states, the draft asks for them per block. The head's acceptance prior
    reaches the service's block-length policy."""
    n = 20
    head = shutil.copytree(llama_head, tmp_path / llama_head.name)
    save_prior(head / eagle_module.ACCEPTANCE_FILE, {("head:0.9", 0): 0.97}, measured_on="a test")
    target = await start_target(TargetEngine(llama))
    address = f"127.0.0.1:{target.port}"
    try:
        draft = await start_draft(lambda info: EagleProposer.load(head, llama.hf_dir, info), address,
                                  num_speculative_tokens=3, target_wait_s=10)
        try:
            assert draft.engine.block_lengths.acceptance.estimate("head:0.9", 0) > 0.85  # not the coin flip
            fingerprint = tokenizer_fingerprint(llama.tokenizer)
            params = common_pb2.SessionParams(max_new_tokens=n)
            async with grpc.aio.insecure_channel(address) as channel:
                first = await target_pb2_grpc.TargetServiceStub(channel).Prefill(target_pb2.PrefillRequest(
                    session_id="e", prompt_token_ids=PROMPT, params=params, tokenizer_fingerprint=fingerprint))
            request = draft_pb2.SpeculateRequest(session_id="e", token_ids=[*PROMPT, first.token_id],
                                                 prompt_len=len(PROMPT), params=params, tokenizer_fingerprint=fingerprint)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{draft.port}") as channel:
                stub = draft_pb2_grpc.DraftServiceStub(channel)
                info = await stub.Info(draft_pb2.DraftServiceInfoRequest())
                responses = [r async for r in stub.Speculate(request)]
        finally:
            await draft.stop(0)
    finally:
        await target.stop(0)
    assert (info.proposer, info.model_name) == ("eagle", f"eagle:{llama_head.name}")
    assert info.tokenizer_fingerprint == tokenizer_fingerprint(llama.tokenizer)
    tokens = [first.token_id, *(t for r in responses for t in r.token_ids)]
    assert tokens == generate_greedy(llama.model, PROMPT, n, llama.tokenizer.eos_token_id)
    assert responses[0].num_draft_tokens == 0 and sum(r.num_draft_tokens for r in responses) > 0


# --------------------------------------------------------------------------- sampling


async def test_seeded_sampling_is_exact_sparse_q_and_reproducible(llama, llama_head):
    proposer = load_eagle(llama_head, llama, draft_top_k=8)
    first, _, blocks = await speculate_in_process(llama, proposer, 20, temperature=1.0, seed=7)
    again, _, _ = await speculate_in_process(llama, proposer, 20, temperature=1.0, seed=7)
    assert first == again
    vocab_ids = set(proposer.drafter.vocab_ids.tolist())
    drafted = [b.proposal for b in blocks if b.proposal.token_ids]
    assert drafted
    for proposal in drafted:
        assert len(proposal.probs) == len(proposal.token_ids)
        for token, q in zip(proposal.token_ids, proposal.probs):
            assert 0 < len(q.token_ids) <= 8 and len(set(q.token_ids)) == len(q.token_ids)
            assert set(q.token_ids) <= vocab_ids and token in q.token_ids
            assert all(p > 0 for p in q.probs) and math.fsum(q.probs) == pytest.approx(1.0, abs=1e-5)


def test_sampled_q_is_the_renormalised_top_k_of_the_tempered_reduced_logits(llama, llama_head):
    proposer = load_eagle(llama_head, llama, draft_top_k=6)
    hidden = torch.randn(2, 32)
    temperature = 0.7

    def first_q(seed: int, **sampling):
        session = proposer.new_session(PROMPT, SamplingParams(temperature=temperature, seed=seed, **sampling))
        session.commit(len(PROMPT), (50, 51), hidden)
        return session.propose(3)

    proposal = first_q(3)
    assert proposal == first_q(3)  # seeded per session
    assert len({first_q(s).token_ids for s in range(4, 12)} | {proposal.token_ids}) > 1
    _, logits = proposer.drafter.step(hidden[-1:], torch.tensor([51]))
    top = torch.softmax(logits[0] / temperature, -1).topk(6)
    expected_ids = proposer.drafter.vocab_ids[top.indices].tolist()
    assert list(proposal.probs[0].token_ids) == expected_ids
    assert torch.allclose(torch.tensor(proposal.probs[0].probs), top.values / top.values.sum(), atol=1e-5)
    # The session's own top_k / top_p narrow q further.
    assert all(len(q.token_ids) <= 2 for q in first_q(3, top_k=2).probs)
    assert all(len(q.token_ids) < 6 for q in first_q(3, top_p=0.3).probs)


# --------------------------------------------------------------------------- the session's state


def test_commit_takes_the_feature_from_the_last_row(llama, llama_head):
    proposer = load_eagle(llama_head, llama)
    session = proposer.new_session(PROMPT, SamplingParams())
    assert isinstance(session, EagleSession)
    assert session.propose(4) == Proposal()  # no feature yet: an empty block
    hidden = torch.randn(3, 32)
    session.commit(len(PROMPT), (60, 61, 62), hidden)
    torch.testing.assert_close(session.feature, hidden[-1])
    proposal = session.propose(4)
    assert len(proposal.token_ids) == 4 and proposal.probs == ()
    # The first draft: one step from the last row's feature and the last committed token.
    _, logits = proposer.drafter.step(hidden[-1:], torch.tensor([62]))
    assert proposal.token_ids[0] == int(proposer.drafter.vocab_ids[logits[0].argmax()])
    # A refused block (nothing committed) keeps the feature; the next proposal is the same.
    session.commit(len(PROMPT) + 3, ())
    assert session.propose(4) == proposal
    # Rows that do not match the committed tokens (or none at all) drop it: the next block is empty.
    session.commit(len(PROMPT) + 3, (70, 71), torch.randn(1, 32))
    assert session.feature is None and session.propose(4) == Proposal()
    session.commit(len(PROMPT) + 5, (72,), torch.randn(1, 32))
    assert session.feature is not None
    anchor = session.feature
    # Tokens taken as committed without states (a pipelined block's assumption): the head rolls its
    # own feature over them, one step from the last verdict's.
    session.commit(len(PROMPT) + 6, (73,), None)
    rolled, _ = proposer.drafter.step(anchor[None], torch.tensor([72]))
    torch.testing.assert_close(session.feature, rolled[0].float())
    assert session.propose(4).token_ids
    # A target whose states lie about their shape (the right number of values, another hidden
    # size) gets no step on them: no crash, an empty block.
    session.commit(len(PROMPT) + 7, (74, 75), torch.randn(2, 32))
    assert session.feature is not None
    session.commit(len(PROMPT) + 9, (76, 77), torch.randn(2, 32).reshape(4, 16)[:2])
    assert session.feature is None and session.propose(4) == Proposal()
    session.close()
    with pytest.raises(RuntimeError):
        session.propose(1)


def test_warm_up_runs_the_head(llama, llama_head, monkeypatch):
    proposer = load_eagle(llama_head, llama)
    steps = []
    original = proposer.drafter.step
    monkeypatch.setattr(proposer.drafter, "step", lambda *a: steps.append(1) or original(*a))
    proposer.warm_up()
    assert len(steps) == 8  # 4 greedy + 4 sampled


def test_proposer_reports_itself(llama, llama_head):
    proposer = load_eagle(llama_head, llama)
    assert proposer.kind == "eagle" and proposer.wants_hidden_states
    assert proposer.model_name == f"eagle:{llama_head.name}"
    assert proposer.tokenizer_fingerprint == tokenizer_fingerprint(llama.tokenizer)
    # The borrowed embedding stays in bf16 (half the memory), and by default steps run in bf16 too.
    assert proposer.drafter.target.embed.dtype == torch.bfloat16
    assert proposer.drafter.target.head_rows.shape == (REDUCED, 32)
    assert proposer.drafter.target.head_rows.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in proposer.drafter.head.parameters())
    assert not HfProposer(llama).wants_hidden_states


def test_a_converted_gguf_targets_embedding_is_looked_up_from_its_own_blocks(tiny_gguf_gemma, tmp_path):
    """A target converted from a GGUF keeps the file's blocks beside its float checkpoint; an eagle
    draft on a CPU looks the embedding's rows up from them: the same values as the float weight in
    a quarter of its bytes. Blocks that are not the checkpoint's embedding, or none, leave bf16."""
    hf_dir, gguf_path = tiny_gguf_gemma
    converted = tmp_path / "converted"
    shutil.copytree(hf_dir, converted)
    write_blocks(gguf_path, converted / BLOCKS_FILE)
    loaded = load_tiny(converted)
    dense = loaded.model.model.embed_tokens.weight.detach()  # [vocab, hidden] float32
    blocks = cached_embedding(converted, dense)
    assert blocks is not None and torch.equal(dequantize(blocks), dense)
    assert blocks.nbytes < dense.numel() * dense.element_size() / 2
    assert cached_embedding(hf_dir, dense) is None  # no blocks file: not a conversion
    assert cached_embedding(converted, dense * 1.01) is None  # not this checkpoint's embedding
    head = make_head(tmp_path / "head", loaded)
    proposer = load_eagle(head, loaded, dtype=torch.float32)
    assert isinstance(proposer.drafter.target.embed, QuantizedTensor)
    ids = torch.tensor([0, 7, int(dense.shape[0]) - 1])
    assert torch.equal(proposer.drafter.embed(ids), dense[ids])
    plain = load_eagle(make_head(tmp_path / "plain-head", load_tiny(hf_dir)), load_tiny(hf_dir))
    assert plain.drafter.target.embed.dtype == torch.bfloat16


def test_a_heads_acceptance_prior_is_loaded_with_it(llama, llama_head, tmp_path):
    from draft_service.proposers.ngram import NgramProposer
    from draft_service.proposers.ngram_first import NgramFirstProposer

    assert load_eagle(llama_head, llama).acceptance_prior is None  # none shipped: the policy starts from Laplace
    head = shutil.copytree(llama_head, tmp_path / "with-prior")
    rates = {("lookup:8", 0): 0.93, ("head:0.7", 1): 0.61}
    save_prior(head / eagle_module.ACCEPTANCE_FILE, rates, measured_on="a test")
    proposer = load_eagle(head, llama)
    assert proposer.acceptance_prior == rates
    assert NgramFirstProposer(NgramProposer(), proposer, head_k=3).acceptance_prior == rates
    (head / eagle_module.ACCEPTANCE_FILE).write_text('{"format": 1, "rates": {"head:0.7": [2.0]}}')
    with pytest.raises(PriorFileError, match="with-prior"):
        load_eagle(head, llama)


def test_a_vocab_limit_keeps_the_most_frequent_prefix(llama, llama_head):
    """The head's vocabulary is ordered by how often the target picked each token, so a limit keeps
    a prefix: the same rows, the same logits for them, and ids still mapped to the target's."""
    full = load_eagle(llama_head, llama, dtype=torch.float32)
    cut = load_eagle(llama_head, llama, dtype=torch.float32, vocab_limit=50)
    assert torch.equal(cut.drafter.vocab_ids, full.drafter.vocab_ids[:50])
    assert torch.equal(cut.drafter.target.head_rows, full.drafter.target.head_rows[:50])
    feature = torch.randn(2, 32)  # [b, hidden]
    tokens = torch.tensor([40, 41])  # [b]
    _, full_logits = full.drafter.step(feature, tokens)  # [2, REDUCED]
    _, cut_logits = cut.drafter.step(feature, tokens)  # [2, 50]
    torch.testing.assert_close(cut_logits, full_logits[:, :50])
    # A limit past the head's own vocabulary keeps all of it; a negative one is refused.
    assert load_eagle(llama_head, llama, vocab_limit=10_000).drafter.vocab_ids.numel() == REDUCED
    with pytest.raises(ValueError, match="vocab_limit"):
        load_eagle(llama_head, llama, vocab_limit=-1)
    # Every drafted id is one of the kept ones.
    session = cut.new_session(PROMPT, SamplingParams())
    session.commit(len(PROMPT), (7,), torch.randn(1, 32))
    assert set(session.propose(4).token_ids) <= set(cut.drafter.vocab_ids.tolist())


def test_bf16_steps_follow_the_fp32_head(llama, llama_head):
    """bf16 steps are for speed only: their logits stay close to fp32's, and they come back float32
    (the sampler's q is computed from them)."""
    fp32 = load_eagle(llama_head, llama, dtype=torch.float32)
    bf16 = load_eagle(llama_head, llama, dtype=torch.bfloat16)
    feature = torch.randn(4, 32)  # [b, hidden]
    tokens = torch.tensor([40, 41, 42, 43])  # [b]
    f32_feature, f32_logits = fp32.drafter.step(feature, tokens)
    b16_feature, b16_logits = bf16.drafter.step(feature, tokens)
    assert b16_logits.dtype == torch.float32 and b16_logits.shape == f32_logits.shape
    torch.testing.assert_close(b16_logits, f32_logits, atol=0.05 * float(f32_logits.abs().max()), rtol=0.05)
    torch.testing.assert_close(b16_feature.float(), f32_feature, atol=0.05 * float(f32_feature.abs().max()), rtol=0.05)


@pytest.mark.parametrize("isa", ["reference", "reference-int8"])
def test_q8_0_steps_follow_the_fp32_head(llama, llama_head, isa):
    """With a quantized kernel the head's layers and LM-head rows are Q8_0 blocks (a byte a weight):
    logits and features stay close to fp32's, and every product goes through the kernel."""
    fp32 = load_eagle(llama_head, llama, dtype=torch.float32)
    q8 = load_eagle(llama_head, llama, kernel=QuantKernel(isa))
    assert q8.drafter.weights == f"Q8_0 ({isa})" and q8.drafter.dtype == torch.float32
    assert all(isinstance(m, QuantLinear) for m in q8.drafter.head.mlp if not isinstance(m, torch.nn.SiLU))
    feature = torch.randn(4, 32)  # [b, hidden]
    tokens = torch.tensor([40, 41, 42, 43])  # [b]
    f32_feature, f32_logits = fp32.drafter.step(feature, tokens)
    q8_feature, q8_logits = q8.drafter.step(feature, tokens)
    assert q8_logits.dtype == torch.float32 and q8_logits.shape == f32_logits.shape
    torch.testing.assert_close(q8_logits, f32_logits, atol=0.05 * float(f32_logits.abs().max()), rtol=0.05)
    torch.testing.assert_close(q8_feature, f32_feature, atol=0.05 * float(f32_feature.abs().max()), rtol=0.05)


def test_a_head_whose_widths_do_not_block_keeps_bf16(llama, tmp_path):
    odd = make_head(tmp_path / "odd", llama, inner_size=48)  # Linear(48, 48): not a multiple of 32
    proposer = load_eagle(odd, llama, kernel=QuantKernel("reference"))
    assert proposer.drafter.kernel is None and proposer.drafter.weights == "bfloat16"


def test_settings_choose_the_drafters_dtype_and_vocabulary(llama, llama_head, monkeypatch):
    """``--dtype auto`` means Q8_0 steps for an eagle head on a CPU with a quantized kernel (the
    probe's), bf16 steps without one; ``--eagle-vocab`` limits its rows."""
    info = target_info(llama)
    settings = DraftSettings(draft_model=str(llama_head), target_model=str(llama.hf_dir), device="cpu")
    assert settings.eagle_vocab == 4096
    monkeypatch.setenv("TANDEM_QUANT_KERNEL", "none")
    proposer = make_proposer(settings, info)
    assert proposer.drafter.dtype == torch.bfloat16 and proposer.drafter.kernel is None
    assert proposer.drafter.vocab_ids.numel() == REDUCED
    monkeypatch.delenv("TANDEM_QUANT_KERNEL")
    isa = probe()[0]
    if isa is not None:  # every x86 host with AVX2 and a compiler
        proposer = make_proposer(settings, info)
        assert proposer.drafter.weights == f"Q8_0 ({isa})"
    settings = DraftSettings(
        draft_model=str(llama_head), target_model=str(llama.hf_dir), device="cpu", dtype="float32", eagle_vocab=16
    )
    proposer = make_proposer(settings, info)
    assert proposer.drafter.dtype == torch.float32 and proposer.drafter.vocab_ids.numel() == 16


# --------------------------------------------------------------------------- refusals and spec resolution


def test_a_head_for_another_target_is_refused(llama, llama_head):
    config = load_head(llama_head)[0].config
    ok = target_info(llama)
    check_head_fits_target(config, "h", ok)
    other = target_info(llama, model_name="other-model", tokenizer_fingerprint="f" * 32)
    with pytest.raises(IncompatibleDraftError) as refused:
        EagleProposer.load(llama_head, llama.hf_dir, other)
    message = str(refused.value)
    assert config.target_fingerprint in message and "f" * 32 in message
    assert "other-model" in message and llama_head.name in message and "tandem distill --kind eagle" in message
    with pytest.raises(IncompatibleDraftError, match=r"hidden size 32 \(head\) vs 64 \(target\)"):
        check_head_fits_target(config, "h", target_info(llama, hidden_size=64))
    with pytest.raises(IncompatibleDraftError, match=r"vocabulary size 300 \(head\) vs 512 \(target\)"):
        check_head_fits_target(config, "h", target_info(llama, vocab_size=512))


async def test_the_draft_service_refuses_a_mismatched_head(llama, tmp_path):
    head = make_head(tmp_path / "wrong", llama, target_fingerprint="0" * 32, target_model="some-other-target")
    target = await start_target(TargetEngine(llama))
    try:
        with pytest.raises(IncompatibleDraftError, match="some-other-target"):
            await start_draft(lambda info: EagleProposer.load(head, llama.hf_dir, info),
                              f"127.0.0.1:{target.port}", target_wait_s=10)
    finally:
        await target.stop(0)


def test_spec_resolution(llama, llama_head, tiny_dir, tmp_path, monkeypatch):
    assert is_eagle_draft("eagle") and is_eagle_draft(str(llama_head))
    assert not is_eagle_draft("ngram") and not is_eagle_draft(str(tiny_dir))
    # A head directory is an eagle draft for whatever target the settings name.
    settings = DraftSettings(draft_model=str(llama_head), target_model=str(tiny_dir), device="cpu")
    proposer = make_proposer(settings, target_info(llama))
    assert isinstance(proposer, EagleProposer) and proposer.model_name == f"eagle:{llama_head.name}"
    # ``eagle`` = the head shipped for a built-in target ...
    shipped = tmp_path / "shipped"
    make_head(shipped / "gemma-3-270m", llama)
    monkeypatch.setattr(eagle_module, "BUILTIN_HEADS_DIR", shipped)
    assert eagle_head_dir("eagle", "gemma-3-270m") == shipped / "gemma-3-270m"
    # ... and a target without one is a clear error that says how to get one.
    with pytest.raises(ModelSpecError, match="tandem distill --kind eagle") as missing:
        make_proposer(DraftSettings(draft_model="eagle", target_model=str(tiny_dir)), target_info(llama))
    assert str(tiny_dir) in str(missing.value) and "gemma-3-270m" in str(missing.value)


def test_settings_carry_the_target_model(monkeypatch):
    for var in ("TARGET_MODEL", "TANDEM_TARGET_MODEL", "DRAFT_MODEL", "TANDEM_DRAFT_MODEL"):
        monkeypatch.delenv(var, raising=False)
    assert DraftSettings().target_model == "gemma-3-270m"
    monkeypatch.setenv("TANDEM_TARGET_MODEL", "/models/t")
    assert DraftSettings().target_model == "/models/t"


# --------------------------------------------------------------------------- the wire


def test_hidden_states_on_the_draft_wire():
    block = ProposedBlock("s", 3, 10, Proposal((5,)), return_hidden_states=True)
    assert wire.verify_request(block).return_hidden_states is True
    assert wire.verify_request(ProposedBlock("s", 3, 10, Proposal((5,)))).return_hidden_states is False
    hidden = torch.randn(2, 8)
    response = target_pb2.VerifyResponse(
        block_id=3, status=target_pb2.VERDICT_STATUS_OK, num_accepted=1, committed_token_ids=[5, 6],
        committed_len=12, hidden_states=codecs.hidden_states_to_wire(hidden),
    )
    verdict = wire.verdict_from_response(response)
    assert verdict.hidden_states.dtype == torch.float32
    torch.testing.assert_close(verdict.hidden_states, hidden.half().float())
    bf16 = hidden.to(torch.bfloat16)
    message = common_pb2.HiddenStates(data=bf16.view(torch.int16).numpy().astype("<i2").tobytes(), shape=[2, 8],
                                      dtype="bfloat16")
    torch.testing.assert_close(wire.hidden_states(message), bf16.float())
    response.ClearField("hidden_states")
    assert wire.verdict_from_response(response).hidden_states is None
    response.hidden_states.CopyFrom(common_pb2.HiddenStates(data=b"\0" * 6, shape=[2, 8], dtype="float16"))
    with pytest.raises(Exception, match="come with 6 bytes"):
        wire.verdict_from_response(response)


# --------------------------------------------------------------------------- reduced-vocabulary hf drafts


def make_reduced_draft(folder: Path, loaded, vocab_ids: torch.Tensor) -> Path:
    """The target itself restricted to ``vocab_ids``: its embedding and head rows in reduced order.

    On prompts inside the set it computes the target's logits for those ids, so with the full
    vocabulary permuted it agrees with the target everywhere; a wrong id mapping would not.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(loaded.hf_dir), dtype=torch.float32)
    embed = model.get_input_embeddings().weight.detach()[vocab_ids].clone()  # [reduced, hidden]
    head = model.get_output_embeddings().weight.detach()[vocab_ids].clone()  # [reduced, hidden]
    model.resize_token_embeddings(len(vocab_ids))
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(embed)
        model.get_output_embeddings().weight.copy_(head)
    model.config.vocab_size = len(vocab_ids)
    model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    save_file({"vocab_ids": vocab_ids.to(torch.int64).contiguous()}, str(folder / VOCAB_IDS_FILE))
    return folder


@pytest.mark.parametrize("kept", [VOCAB, 200])
async def test_reduced_vocabulary_hf_draft_is_lossless(llama, tmp_path, kept):
    order = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    prompt_ids = set(PROMPT)
    # Keep the prompt's ids (so the draft sees the prompt exactly) and a random part of the rest.
    rest = [int(i) for i in order if int(i) not in prompt_ids]
    vocab_ids = torch.tensor([*[int(i) for i in order if int(i) in prompt_ids], *rest[: kept - len(prompt_ids)]])
    draft = load_model(str(make_reduced_draft(tmp_path / "reduced", llama, vocab_ids)), device="cpu", dtype="float32")
    proposer = HfProposer(draft, vocab_limit=VOCAB)
    assert proposer.vocab_map is not None and proposer.vocab_limit == kept
    n = 30
    reference = ReferenceTarget(llama.model, (llama.tokenizer.eos_token_id,))
    first, _ = reference.prefill("s", PROMPT, max_new_tokens=n)
    committed = (*PROMPT, first)
    spec = SessionSpec("s", committed, len(PROMPT), SamplingParams(), 4, session_max_new_tokens=n)
    verifier = InMemoryVerifier(reference)
    results = [r async for r in SpeculationLoop(spec, proposer.new_session(committed, SamplingParams()), verifier,
                                                run_inline).rounds()]
    tokens = [first, *(t for r in results for t in r.token_ids)]
    assert tokens == generate_greedy(llama.model, PROMPT, n, llama.tokenizer.eos_token_id)
    kept_ids = set(vocab_ids.tolist())
    assert all(t in kept_ids for b in verifier.blocks for t in b.proposal.token_ids)
    if kept == VOCAB:  # the target itself, permuted: every draft token is accepted
        assert all(r.num_accepted == r.num_draft_tokens for r in results[:-1])
        assert sum(r.num_draft_tokens for r in results) > n // 2
    # Sampling: q's support is in target ids, inside the kept set.
    session = proposer.new_session(committed, SamplingParams(temperature=1.0, seed=0))
    proposal = session.propose(4)
    assert all(set(q.token_ids) <= kept_ids and t in q.token_ids for t, q in zip(proposal.token_ids, proposal.probs))


def test_a_reduced_vocabulary_beyond_the_target_is_refused(llama, tmp_path):
    draft = load_model(str(make_reduced_draft(tmp_path / "r", llama, torch.arange(VOCAB))), device="cpu",
                       dtype="float32")
    with pytest.raises(ValueError, match="beyond the target's vocabulary of 200"):
        HfProposer(draft, vocab_limit=200)
