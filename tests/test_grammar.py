"""Structured output's grammars (engine.grammar) and their use in the lanes (lanes.contract): the matcher on
the small model's tokenizer (masks, a padded vocabulary, EOS only where the output is complete, rollback,
termination, tool-call markup, reasoning sections, the compile cache, errors); the speculative round's
masked verify (a draft outside the grammar is rejected, greedy and sampled); and constrained requests
through the engine on the tiny spec (random weights, byte vocabulary): valid JSON with K = 0 and K = 3,
K = 3 greedy equal to K = 0 greedy token for token, constrained and free lanes in one cohort each equal
to their run alone. Free requests are unchanged: tests/test_engine.py runs them as before."""
import json

import pytest
import torch

pytest.importorskip("llguidance")

from compiler.spec import load_spec  # noqa: E402
from ninfer_gen.engine import Engine, Request
from ninfer_gen.lanes.reference import ReferenceLanes  # noqa: E402
from ninfer_gen.api import DEFAULT_MODEL, TINY_SPEC  # noqa: E402
from ninfer_gen.engine.grammar import (GrammarCompiler, GrammarError, GrammarViolation, ToolSpec,  # noqa: E402
                                       grammar_text)
from ninfer_gen.lanes.contract import masked_verify  # noqa: E402
from ninfer_gen.sampling import SamplingParams, distribution  # noqa: E402
from ninfer_gen.speculative import accept_greedy, accept_sampled  # noqa: E402
from ninfer_gen.engine.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from ninfer_gen.reference import ReferenceBackend  # noqa: E402
from ninfer_gen.weights.random_weights import random_weights  # noqa: E402

EOS = 0                                    # the small model's <|endoftext|>
PADDED = 8192 + 64                         # a model vocabulary past the tokenizer's 8,192 ids
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"]}
PICK = {"$defs": {"Q": {"enum": ["a", "b"]}}, "type": "object",
        "properties": {"q": {"$ref": "#/$defs/Q"}, "more": {"$ref": "#"}}, "required": ["q"]}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEFAULT_MODEL, 8192)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, PADDED, {EOS})


def _walk(matcher, tok, text: str) -> None:
    for t in tok.encode(text):
        assert matcher.allows(t), f"{tok.decode([t])!r} refused after {matcher.consumed} tokens"
        matcher.consume(t)


def test_json_schema_masks_eos_padding_and_termination(compiler, tok):
    m = compiler.json_schema(WEATHER).matcher()
    first = m.allowed()
    assert first.shape == (PADDED,) and first.dtype == torch.bool
    assert tok.decode(first.nonzero().flatten().tolist()) == "{"          # compact JSON: only "{" opens it
    assert not first[8192:].any() and not first[EOS]
    logits = torch.zeros(PADDED)
    masked = m.mask(logits)
    assert torch.isinf(masked[~first]).all() and (masked[first] == 0).all() and (logits == 0).all()
    _walk(m, tok, '{"city": "Paris", "days": 3')
    assert not m.allows(EOS) and not m.is_accepting and not m.is_terminated
    assert m.allows(tok.encode("}")[0]) and m.allows(tok.encode("0")[0])   # close, or more digits
    _walk(m, tok, "}")
    assert m.is_accepting and m.allowed().nonzero().flatten().tolist() == [EOS]     # complete: only EOS
    m.consume(EOS)
    assert m.is_terminated
    refused = compiler.json_schema(WEATHER).matcher()
    with pytest.raises(GrammarViolation):
        refused.consume(tok.encode("[")[0])


def test_rollback_restores_the_masks(compiler, tok):
    m = compiler.json_schema(WEATHER).matcher()
    ids = tok.encode('{"city": "Oslo", "days": 12}')
    masks = []
    for t in ids:
        masks.append(m.allowed().clone())
        m.consume(t)
    for n in (1, 4, len(ids)):
        m.rollback(n)
        assert m.consumed == len(ids) - n and torch.equal(m.allowed(), masks[len(ids) - n])
        m.consume_all(ids[len(ids) - n:])
    assert m.is_accepting


def test_compile_cache_and_errors(compiler):
    a = compiler.json_schema(WEATHER)
    assert compiler.json_schema(json.loads(json.dumps(WEATHER))) is a          # cached by the grammar's text
    assert compiler.json_object() is not a and compiler.json_object() is compiler.json_object()
    assert a.matcher()._m is not a.matcher()._m                               # each request its own state
    with pytest.raises(GrammarError, match="foo"):
        compiler.json_schema({"type": "foo"})
    assert "foo" in compiler.check_schema({"type": "object", "properties": {"x": {"type": "foo"}}})
    assert compiler.check_schema(WEATHER) is None and "object" in compiler.check_schema([1])
    with pytest.raises(GrammarError, match="EOS"):
        GrammarCompiler(ByteTokenizer(512), 512, set())


def test_tool_calls_markup_names_refs_and_parallel_calls(compiler, tok):
    tools = [ToolSpec("get_weather", WEATHER), ToolSpec("pick", PICK)]
    one = '<tool_call>\n{"name": "pick", "arguments": {"q": "b", "more": {"q": "a"}}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    m = compiler.tool_calls(tools).matcher()
    _walk(m, tok, two)
    assert m.is_accepting
    single = compiler.tool_calls(tools, parallel=False).matcher()
    _walk(single, tok, one)
    assert single.allowed().nonzero().flatten().tolist() == [EOS]             # one call only
    for bad in ('<tool_call>\n{"name": "get_time"', '<tool_call>\n{"name": "pick", "arguments": {"q": "c"',
                '<tool_call>\n{"arguments"', "Sure"):
        m = compiler.tool_calls(tools).matcher()
        ids = tok.encode(bad)
        ok = 0
        while ok < len(ids) and m.allows(ids[ok]):
            m.consume(ids[ok])
            ok += 1
        assert ok < len(ids), bad


def test_reasoning_sections_and_choices(compiler, tok):
    body = '{"city": "Lima"}'
    optional = compiler.json_schema(WEATHER, think="optional")
    for text in (body, "<think>\nweather < 3 days?\n</think>\n\n" + body, "<think>x</think>" + body):
        m = optional.matcher()
        _walk(m, tok, text)
        assert m.is_accepting, text
    m = compiler.json_schema(WEATHER, think="open").matcher()       # the prompt opened <think>
    _walk(m, tok, "short thought\n</think>\n\n" + body)
    assert m.is_accepting
    both = compiler.constraint(answer=WEATHER, tools=[ToolSpec("pick", PICK)])  # a call or the answer
    for text in (body, '<tool_call>\n{"name": "pick", "arguments": {"q": "a"}}\n</tool_call>'):
        m = both.matcher()
        _walk(m, tok, text)
        assert m.is_accepting
    with pytest.raises(ValueError):
        grammar_text()
    with pytest.raises(ValueError):
        grammar_text(answer={}, think="maybe")


# ----------------------------------------------------------------- the speculative round's masked verify

def test_masked_verify_rejects_a_draft_outside_the_grammar(compiler, tok):
    """Verify rows whose unmasked argmax is each draft: greedy acceptance keeps the drafts the grammar allows
    and rejects the first it refuses, choosing the masked argmax instead; sampled acceptance never keeps a
    refused draft and draws an allowed token. The matcher is left where it was."""
    m = compiler.json_schema(WEATHER).matcher()
    _walk(m, tok, '{"city": "')
    at = m.consumed
    good = tok.encode("Paris")
    bad = tok.encode("\n")[0]                  # a raw newline: never inside a JSON string
    drafts = good + [bad]
    logits = torch.randn(len(drafts) + 1, PADDED)
    for i, d in enumerate(drafts):
        logits[i, d] = 50.0                        # the target would keep every draft without the grammar
    assert accept_greedy(drafts, logits) == drafts + [int(logits[-1].argmax())]
    before = m.allowed().clone()
    masked = masked_verify(m, drafts, logits)
    assert m.consumed == at and torch.equal(m.allowed(), before)           # state unchanged
    out = accept_greedy(drafts, masked)
    assert out[:len(good)] == good and out[len(good)] != bad and len(out) == len(good) + 1
    m.consume_all(out)                                                    # the emitted tokens fit
    m.rollback(len(out))
    params = SamplingParams(1.0, seed=0)
    q = torch.full((len(drafts), PADDED), 1.0 / PADDED)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        out = accept_sampled(drafts, q, distribution(masked, params), gen)
        assert bad not in out and len(out) <= len(good) + 1
        m.consume_all(out)
        m.rollback(len(out))


# ----------------------------------------------------------------- constrained requests through the engine

SMALL_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
                "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}}}
BYTE_EOS = 256


@pytest.fixture(scope="module")
def tiny():
    spec = load_spec(TINY_SPEC)
    backend = ReferenceBackend(spec, random_weights(spec), device="cpu", max_sequences=4, max_context=128)
    return backend, GrammarCompiler(ByteTokenizer(spec.model.vocab_size), spec.model.vocab_size, {BYTE_EOS})


def _run(backend, requests, lanes=1):
    engine = Engine(ReferenceLanes(backend), lanes=lanes)
    handles = [engine.submit(r) for r in requests]
    engine.run_until_idle()
    return [(h.tokens, h.result()) for h in handles]


def _json(tokens):
    assert tokens[-1] == BYTE_EOS
    return json.loads(bytes(tokens[:-1]).decode())


def test_constrained_requests_on_the_engine_plain_and_speculative(tiny):
    backend, compiler = tiny
    grammar = compiler.json_schema(SMALL_SCHEMA)
    prompt = list(b"answer:")
    stop = {BYTE_EOS}
    reqs = [Request(prompt, 40, stop=stop, constraint=grammar),
            Request(prompt, 40, stop=stop, draft=3, constraint=grammar),
            Request(prompt, 40, SamplingParams(1.0, seed=3), stop, draft=3, constraint=grammar),
            Request(prompt, 40, SamplingParams(0.8, top_k=20, seed=4), stop, constraint=grammar)]
    alone = [_run(backend, [r])[0] for r in reqs]
    for tokens, final in alone:
        value = _json(tokens)
        assert final.finish == "stop" and set(value) == {"a", "b"} and value["a"] in ("x", "yy")
    assert alone[0][0] == alone[1][0]                              # speculative greedy == plain greedy
    assert alone[1][1].stats.drafted > alone[1][1].stats.accepted  # the random MTP's drafts: mostly refused
    free = Request(prompt, 12, draft=3)
    together = _run(backend, reqs + [free], lanes=4)               # constrained and free lanes in one cohort
    assert [t for t, _ in together[:4]] == [t for t, _ in alone]
    assert together[4][0] == _run(backend, [free])[0][0]
    assert backend.slots.free_slots == backend.slots.num_slots


def test_engine_refuses_a_constraint_that_cannot_run(tiny, compiler):
    backend, byte_compiler = tiny
    engine = Engine(ReferenceLanes(backend), lanes=1)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.submit(Request([1, 2], 4, stop={0}, constraint=compiler.json_object()))
    with pytest.raises(ValueError, match="stop tokens"):
        engine.submit(Request([1, 2], 4, constraint=byte_compiler.json_object()))
    with pytest.raises(ValueError, match="compiled grammar"):
        Request([1, 2], 4, constraint="{}")
