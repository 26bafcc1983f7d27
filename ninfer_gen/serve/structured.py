"""structured: the APIs' structured-output fields → an engine constraint (engine.grammar). OpenAI
`response_format` (text / json_object / json_schema; the Responses API's flat `text.format` too) and
`tool_choice` (none / auto / required / a named function), Anthropic `tool_choice` (auto / any / tool /
none, `disable_parallel_tool_use`), with a 400 naming the field for a malformed choice, an invalid
schema or an unknown tool name. `Structured` is what a request asks for; `constrained(...)` compiles it
(one GrammarCompiler per served model, made on first use) and gives the ServeState a Generation submits
through.

Thinking: a constrained request renders its prompt with thinking off (`thinking_for`) unless the client
turned it on explicitly; then the grammar allows a `<think>…</think>` section before the constrained
part (or continues the one the prompt opened). Tool calls are the Qwen markup the chat templates write,
`<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`, one or more (one with parallel calls off);
forced tool calls leave no room for text before them. With tools on "auto" and a JSON response format,
the output is either tool calls or the JSON answer."""
from __future__ import annotations

import asyncio
import copy
import threading
import weakref
from dataclasses import dataclass, replace

from ninfer_gen.engine.grammar import GrammarCompiler, GrammarError, ToolSpec
from ninfer_gen.serve.core import ServeState, bad_request
from ninfer_gen.serve.events import prompt_opens_thinking

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Structured:
    """What a request constrains: `answer`, the JSON schema of a JSON answer (None: free text, or no
    answer when tools are forced); `tools`, the tools a grammar lets the output call; `force_tools`: the
    output must be tool calls; `parallel`: more than one call allowed. `fields` names the request fields
    each part came from (for errors)."""
    answer: dict | None = None
    tools: tuple[ToolSpec, ...] = ()
    force_tools: bool = False
    parallel: bool = True
    answer_field: str = "response_format"
    tools_field: str = "tools"

    @property
    def constrained(self) -> bool:
        return self.answer is not None or self.force_tools


# ---------------------------------------------------------------------------------- the fields


def response_format(value, param: str = "response_format") -> dict | None:
    """The JSON schema a response format asks for (None: text). Chat's {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}} and the Responses API's flat {"type": "json_schema",
    "name", "schema", "strict"} both; {"type": "json_object"} is any JSON object."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request("expected an object {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind != "json_schema":
        raise bad_request(f"expected \"text\", \"json_object\" or \"json_schema\", got {kind!r}", param + ".type")
    where = param + ".json_schema" if "json_schema" in value else param
    spec = value.get("json_schema", value)
    if not isinstance(spec, dict):
        raise bad_request("expected an object {\"name\", \"schema\", \"strict\"}", where)
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise bad_request("expected a string", where + ".name")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise bad_request("expected a boolean", where + ".strict")
    schema = spec.get("schema")
    if schema is None:
        return ANY_OBJECT            # OpenAI: no schema, any JSON object
    if not isinstance(schema, dict):
        raise bad_request("expected a JSON schema (an object)", where + ".schema")
    return schema


def _tool_specs(tools: list[dict] | None) -> tuple[ToolSpec, ...]:
    """Tools in the chat template's shape ({"type": "function", "function": {name, parameters}})."""
    return tuple(ToolSpec(t["function"]["name"], t["function"].get("parameters")) for t in tools or ())


def openai_tool_choice(choice, tools: list[dict] | None, parallel=None, param: str = "tool_choice",
                       tools_param: str = "tools") -> Structured:
    """`tool_choice` of chat completions ({"type": "function", "function": {"name"}}) or of the Responses
    API ({"type": "function", "name"}) over the request's tools (chat template shape, None: none)."""
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("expected a boolean", "parallel_tool_calls")
    parallel = parallel is not False
    if choice is None or choice in ("auto", "none"):
        return Structured(tools=_tool_specs(tools), parallel=parallel, tools_field=tools_param)
    if choice == "required":
        if not tools:
            raise bad_request("tool_choice \"required\" needs tools", param)
        return Structured(tools=_tool_specs(tools), force_tools=True, parallel=parallel, tools_field=tools_param)
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise bad_request(f"expected \"none\", \"auto\", \"required\" or {{\"type\": \"function\", ...}}, got "
                          f"{choice!r}", param)
    named = choice.get("function", choice)
    where = param + (".function.name" if "function" in choice else ".name")
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise bad_request("a function name (string) is required", where)
    return _named(name, tools, where, parallel=False, tools_param=tools_param)


def anthropic_tool_choice(choice, tools: list[dict] | None) -> Structured:
    """Anthropic's `tool_choice` ({"type": "auto" | "any" | "tool" | "none", "name",
    "disable_parallel_tool_use"}) over the request's tools (chat template shape)."""
    choice = choice or {"type": "auto"}
    no_parallel = choice.get("disable_parallel_tool_use", False)
    if not isinstance(no_parallel, bool):
        raise bad_request("expected a boolean", "tool_choice.disable_parallel_tool_use")
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return Structured(tools=_tool_specs(tools), parallel=not no_parallel)
    if kind == "any":
        if not tools:
            raise bad_request("tool_choice 'any' needs tools", "tool_choice")
        return Structured(tools=_tool_specs(tools), force_tools=True, parallel=not no_parallel)
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("a tool name (string) is required", "tool_choice.name")
        return _named(choice["name"], tools, "tool_choice.name", parallel=False, tools_param="tools")
    raise bad_request(f"expected type auto, any, tool or none, got {kind!r}", "tool_choice.type")


def _named(name: str, tools, where: str, parallel: bool, tools_param: str) -> Structured:
    specs = [t for t in _tool_specs(tools) if t.name == name]
    if not specs:
        known = ", ".join(t.name for t in _tool_specs(tools)) or "none"
        raise bad_request(f"no tool named {name!r} among the request's tools ({known})", where)
    return Structured(tools=(specs[0],), force_tools=True, parallel=parallel, tools_field=tools_param)


def with_answer(structured: Structured, answer: dict | None, field: str = "response_format") -> Structured:
    return replace(structured, answer=answer, answer_field=field)


def thinking_for(structured: Structured, requested: bool | None) -> bool | None:
    """The chat template's enable_thinking: off for a constrained request unless the client asked for it."""
    return False if structured.constrained and requested is not True else requested


# ---------------------------------------------------------------------------------- the constraint

_COMPILERS: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(state: ServeState) -> GrammarCompiler:
    """The served model's grammar compiler (its tokenizer prepared once: ~1.5 s at 248K ids)."""
    vocab = state.model.spec.model.vocab_size
    key = (vocab, state.stop_ids)
    with _COMPILERS_LOCK:
        per_model = _COMPILERS.setdefault(state.model, {})
        if key not in per_model:
            per_model[key] = GrammarCompiler(state.model.tokenizer, vocab, state.stop_ids)
        return per_model[key]


def _compile(state: ServeState, structured: Structured, prompt_text: str, thinking: bool | None):
    compiler = compiler_for(state)
    if structured.answer is not None and (why := compiler.check_schema(structured.answer)):
        raise bad_request(f"the JSON schema cannot be used: {why}", structured.answer_field)
    tools = structured.tools if (structured.force_tools or structured.answer is not None) else ()
    for i, tool in enumerate(tools):
        if why := compiler.check_schema(tool.parameters if tool.parameters is not None else ANY_OBJECT):
            raise bad_request(f"tool {tool.name!r}: its parameters' JSON schema cannot be used: {why}",
                              structured.tools_field)
    think = "open" if prompt_opens_thinking(prompt_text) else "optional" if thinking else "none"
    try:
        return compiler.constraint(answer=None if structured.force_tools else structured.answer, tools=tools,
                                   parallel=structured.parallel, think=think)
    except GrammarError as err:
        raise bad_request(f"the constraint cannot be compiled: {err}",
                          structured.tools_field if tools else structured.answer_field) from None


class _ConstrainedEngine:
    """The served engine as one Generation sees it: what it submits carries the request's grammar."""

    def __init__(self, engine, grammar):
        self._engine, self._grammar = engine, grammar

    def submit(self, request):
        return self._engine.submit(replace(request, constraint=self._grammar))

    def __getattr__(self, name):
        return getattr(self._engine, name)


def constrained_now(state: ServeState, structured: Structured | None, prompt_text: str,
                    thinking: bool | None) -> ServeState:
    """The ServeState a Generation of this request submits through: `state` itself when nothing is
    constrained, else a copy whose engine adds the compiled grammar to the request. 400 naming the field
    for what cannot be compiled. Compiles here (~1-2 ms; the model's first grammar also prepares the
    tokenizer, ~1.5 s at 248K ids): an async handler awaits `constrained` instead."""
    if structured is None or not structured.constrained:
        return state
    view = copy.copy(state)
    view.engine = _ConstrainedEngine(state.engine, _compile(state, structured, prompt_text, thinking))
    return view


async def constrained(state: ServeState, structured: Structured | None, prompt_text: str,
                      thinking: bool | None) -> ServeState:
    """`constrained_now` off the event loop."""
    return await asyncio.to_thread(constrained_now, state, structured, prompt_text, thinking)
