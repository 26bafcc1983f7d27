"""grammar: structured output's constraints, on llguidance (lab/notes_grammar.md says why). `GrammarCompiler`
compiles, once per grammar text (an LRU cache), a constraint for one tokenizer and model vocabulary — a JSON
schema, any JSON object, the Qwen tool-call markup over a request's tools, or a choice of tool calls and a
JSON answer — optionally after a reasoning section; a `Grammar` is shareable and immutable, and its
`matcher()` is one request's state: the allowed tokens of the next position over the model's vocabulary
(ids past the tokenizer's are never allowed; EOS only where the grammar is complete), `consume`,
`rollback` (rejected drafts) and `is_terminated`. Imports no CUDA; the server builds constraints, the
lanes apply them (lanes.contract).

The grammars never use llguidance's `stop=` lexemes (they cannot be rolled back): a reasoning section is a
lazy lexeme ending at the first `</think>`. JSON is written with json.dumps's separators (", ", ": ") and no
other whitespace, as the chat templates' `tojson` writes tool calls, and objects that list their properties
are closed to others (`closed`): free whitespace and invented keys are where a small model wanders."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

THINK_MODES = ("none", "optional", "open")
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_OPEN, CALL_CLOSE = "<tool_call>\n", "\n</tool_call>"
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message says why (llguidance's words)."""


class GrammarViolation(RuntimeError):
    """A token the grammar does not allow was consumed, or the grammar allows no token at all."""


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call: its name and the JSON schema of its arguments (an object)."""
    name: str
    parameters: dict | None = None


def _rebase_refs(schema, base: str):
    """The schema with its local `$ref`s ("#…") pointing under `base`, where it is embedded."""
    if isinstance(schema, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebase_refs(v, base)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebase_refs(v, base) for v in schema]
    return schema


_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems", "allOf")
_OPENING = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema, member_of_all: bool = False):
    """The schema with every object that lists `properties` and says nothing of other keys closed to them
    (`additionalProperties: false`), as xgrammar's strict mode and OpenAI's strict schemas do: the outputs
    stay valid, and a small model cannot wander into invented keys. An `allOf` member stays open (closing
    it would refuse its siblings' properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub, key == "allOf") for sub in out[key]]
    if isinstance(out.get("properties"), dict) and not member_of_all and not any(k in out for k in _OPENING):
        out["additionalProperties"] = False
    return out


def _json_rule(schema: dict) -> str:
    return "%json " + json.dumps({**closed(schema), "x-guidance": JSON_FORMAT})


def _call_schema(tool: ToolSpec) -> dict:
    """One call's JSON as the chat templates write it: {"name": NAME, "arguments": {...}}, in that order."""
    args = tool.parameters if tool.parameters is not None else {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             "arguments": _rebase_refs(args, "#/properties/arguments")},
            "required": ["name", "arguments"], "additionalProperties": False}


def grammar_text(*, answer: dict | None = None, tools: tuple[ToolSpec, ...] = (), parallel: bool = True,
                 think: str = "none") -> str:
    """The Lark grammar of a constraint: after the reasoning section `think` allows, the output is one of
    tool calls (≥ 1, one only unless `parallel`) of `tools`, or a JSON value of the `answer` schema."""
    if think not in THINK_MODES:
        raise ValueError(f"think must be one of {THINK_MODES}, got {think!r}")
    if answer is None and not tools:
        raise ValueError("a constraint needs an answer schema or tools")
    rules = {"none": ["start: body"],
             "optional": ["start: think? body", 'think: "<think>" think_text nl?'],
             "open": ["start: think_text nl? body"]}[think]
    if think != "none":
        rules += [r"think_text[lazy]: /(?s:.*)<\/think>/", r'nl: "\n" | "\n\n"']
    choices = []
    if tools:
        choices.append("calls")
        rules.append('calls: call ("\\n" call)*' if parallel else "calls: call")
        rules.append(f"call: {json.dumps(CALL_OPEN)} ({' | '.join(f'tool{i}' for i in range(len(tools)))}) "
                     f"{json.dumps(CALL_CLOSE)}")
        rules += [f"tool{i}: {_json_rule(_call_schema(t))}" for i, t in enumerate(tools)]
    if answer is not None:
        choices.append("answer")
        rules.append(f"answer: {_json_rule(answer)}")
    rules.append("body: " + " | ".join(choices))
    return "\n".join(rules) + "\n"


class Matcher:
    """One request's grammar state. `allowed()` is the next position's mask (bool [vocab_size], CPU);
    `mask(logits)` sets the disallowed logits to −inf; `consume(token)` advances (GrammarViolation for a
    token outside the grammar: check `allows` first for a token that may be refused, e.g. a draft);
    `rollback(n)` takes back the last n consumed tokens."""

    def __init__(self, grammar: "Grammar", llmatcher):
        self.grammar, self._m = grammar, llmatcher
        self._words = torch.empty((grammar.vocab_size + 31) // 32, dtype=torch.int32)
        self._allowed: torch.Tensor | None = None      # the mask of the current position, once computed
        self.consumed = 0

    def allowed(self) -> torch.Tensor:
        if self._allowed is None:
            self._check()
            self._m.unsafe_compute_mask_ptr(self._words.data_ptr(), self._words.numel() * 4)
            self._check()
            bits = (self._words.unsqueeze(-1) >> _BITS) & 1
            self._allowed = bits.flatten()[:self.grammar.vocab_size].bool()
            if not self._allowed.any():
                raise GrammarViolation(f"the grammar allows no token after {self.consumed} tokens")
        return self._allowed

    def allows(self, token: int) -> bool:
        return 0 <= token < self.grammar.vocab_size and bool(self.allowed()[token])

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [..., V] with every token the grammar disallows here at −inf (a new tensor)."""
        allowed = self.allowed().to(logits.device)
        return logits.masked_fill(~allowed, float("-inf"))

    def consume(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise GrammarViolation(f"token {token} is outside the grammar after {self.consumed} tokens: "
                                   f"{self._m.get_error()}")
        self.consumed += 1
        self._allowed = None

    def consume_all(self, tokens) -> None:
        for t in tokens:
            self.consume(t)

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise GrammarViolation(f"cannot roll back {n} tokens: {self._m.get_error()}")
        self.consumed -= n
        self._allowed = None

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and takes no more text: only EOS is allowed (or EOS was consumed)."""
        return self._m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        """What was consumed is a complete output (EOS is allowed here)."""
        return self._m.is_accepting()

    def _check(self) -> None:
        if self._m.is_error():
            raise GrammarViolation(self._m.get_error())


class Grammar:
    """A compiled constraint: immutable, shared by every request that uses it; `matcher()` starts one."""

    def __init__(self, text: str, pristine, vocab_size: int, eos_ids: frozenset[int]):
        self.text, self._pristine, self.vocab_size, self.eos_ids = text, pristine, vocab_size, eos_ids

    def matcher(self) -> Matcher:
        return Matcher(self, self._pristine.deep_copy())


class _ByteVocab:
    """llguidance's tokenizer interface over engine.tokenizer.ByteTokenizer's ids (id = byte value); the ids
    past 255 are special tokens (never text)."""

    def __init__(self, vocab_size: int, eos: int):
        self.eos_token_id, self.bos_token_id = eos, None
        self.tokens = [bytes([i]) for i in range(256)] + [f"<|id{i}|>".encode() for i in range(256, vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


class GrammarCompiler:
    """Compiles constraints for one tokenizer and model vocabulary (`vocab_size` ≥ the tokenizer's) with the
    given EOS ids (the request's stop tokens: where the grammar is complete, only they are allowed).
    Compiled grammars are cached by their text (`cache_size` of them, least recently used dropped).
    Thread-safe; preparing the tokenizer takes ~0.03 s at 8K ids, ~1.5 s at 248K: make one per model."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, cache_size: int = 256):
        import llguidance

        self._llg = llguidance
        self.vocab_size, self.eos_ids = int(vocab_size), frozenset(int(i) for i in eos_ids)
        if not self.eos_ids:
            raise GrammarError("the model has no EOS token: a constrained output could never end")
        eos = sorted(self.eos_ids)
        hf = getattr(tokenizer, "_tok", None)           # engine.tokenizer.HFTokenizer's tokenizers.Tokenizer
        if hf is not None:
            self.tokenizer = llguidance.LLTokenizer(hf.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        else:                                           # ByteTokenizer: id = byte value
            wrapper = llguidance.TokenizerWrapper(_ByteVocab(self.vocab_size, eos[0]))
            self.tokenizer = llguidance.LLTokenizer(wrapper, n_vocab=self.vocab_size, eos_token=eos)
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, text: str) -> Grammar:
        """A Lark grammar (llguidance's dialect) → Grammar; GrammarError naming what is wrong with it."""
        with self._lock:
            if text in self._cache:
                self._cache.move_to_end(text)
                return self._cache[text]
        pristine = self._llg.LLMatcher(self.tokenizer, self._llg.LLMatcher.grammar_from_lark(text), log_level=0)
        if pristine.is_error():
            raise GrammarError(pristine.get_error())
        grammar = Grammar(text, pristine, self.vocab_size, self.eos_ids)
        with self._lock:
            self._cache[text] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    def check_schema(self, schema) -> str | None:
        """Why a JSON schema cannot be compiled, or None (to name the one of several that fails)."""
        if not isinstance(schema, dict):
            return f"a JSON schema must be an object, got {type(schema).__name__}"
        try:
            text = self._llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        except ValueError as err:
            return str(err)
        return self._llg.LLMatcher.validate_grammar(text, self.tokenizer) or None

    def json_schema(self, schema: dict, think: str = "none") -> Grammar:
        return self.constraint(answer=schema, think=think)

    def json_object(self, think: str = "none") -> Grammar:
        return self.constraint(answer={"type": "object"}, think=think)

    def tool_calls(self, tools, *, parallel: bool = True, think: str = "none") -> Grammar:
        return self.constraint(tools=tools, parallel=parallel, think=think)

    def constraint(self, *, answer: dict | None = None, tools=(), parallel: bool = True,
                   think: str = "none") -> Grammar:
        """Tool calls of `tools` or a JSON answer of schema `answer` (either may be absent), after the
        reasoning section `think` allows: none, optional (`<think>…</think>` may open the output) or open
        (the prompt opened `<think>`: the output continues it, closes it, then the body)."""
        if answer is not None and not isinstance(answer, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(answer).__name__}")
        return self.compile(grammar_text(answer=answer, tools=tuple(tools), parallel=parallel, think=think))
