"""chat_template: one conversation rendered by a chat template's text (`render_chat_template`), with the
semantics of `transformers`' `apply_chat_template(..., tokenize=False)`; knows no model folder (serve.chat
reads those and picks the template).

Rendering, as `transformers` does it: a sandboxed (immutable) Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension and the `{% generation %}` block (rendered as its body),
`raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` filter that does not escape HTML and writes
non-ASCII as is (`ensure_ascii=False`, with `indent`, `separators`, `sort_keys`), a `namespace` that
refuses underscore attributes; the variables `messages`, `tools`, `documents`, `add_generation_prompt`,
the named special tokens (`bos_token`, `eos_token`, …) and any extra keyword (`enable_thinking`, …,
which overrides a special token of the same name). Message keys whose value is None are dropped, and a
message's reasoning given as `reasoning_content`, `thinking` or `reasoning` is visible under the first
two names. `continue_final_message` leaves the last message open for the model to continue.

Errors are `ChatTemplateError` (a ValueError; a server answers them with a 4xx) and name the template and
the problem: a syntax error and its line, `raise_exception`'s message, an undefined variable, a message
that is not JSON data."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_RENDER_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")


class ChatTemplateError(ValueError):
    """A chat template that cannot be found, compiled or rendered for a conversation."""


# ---------------------------------------------------------------------------------------------- Jinja


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """What `raise_exception` in a template raises: the template refused its input."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` (HF marks assistant text with it for training masks):
    rendered as its body; no mask is computed here."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _refuse_underscore(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template may not set the underscore attribute {name!r} "
                                              "on a namespace")


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()` without underscore attributes (as HF: no way to reach Python internals)."""

    def __init__(*args, **kwargs):
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _refuse_underscore(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _refuse_underscore(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _DictFactory:
    """`dict(...)` and `dict.fromkeys(...)` in templates, and nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message):
    raise _TemplateRaised(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_DictFactory(),
                       namespace=_Namespace)
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def _compiled(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


# ------------------------------------------------------------------------------------------ messages


def _plain(value, where: str):
    """A fresh copy of JSON-shaped data (what the template sees; never the caller's objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, Mapping):
        return {_plain(k, where): _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        items = [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if isinstance(value, tuple) else items
    raise ChatTemplateError(f"{where}: a {type(value).__name__} is not JSON data (strings, numbers, booleans, "
                            "null, lists and objects only)")


def _prepare_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"messages: expected a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages: the conversation is empty; a chat needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}]: expected an object with a role, got {type(message).__name__}")
        # HF drops keys whose value is None (OpenAI clients send content=None, tool_calls=None).
        message = _plain({k: v for k, v in message.items() if v is not None}, f"messages[{i}]")
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


# ------------------------------------------------------------------------------------------- render


def render_chat_template(source: str, messages, tools=None, *, add_generation_prompt: bool = False,
                         continue_final_message: bool | str = False, documents=None,
                         special_tokens: Mapping[str, str] | None = None, where: str = "chat template",
                         **kwargs) -> str:
    """One conversation rendered by the template text `source`, as `apply_chat_template(..., tokenize=False)`
    would: `special_tokens` and `kwargs` (e.g. `enable_thinking=False`) become template variables."""
    for name in _RENDER_ARGUMENTS:
        if name in kwargs:
            raise ChatTemplateError(f"'{name}' is set by the renderer and cannot be passed as an extra variable")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other: one continues "
                                "the last message, the other opens a new assistant message")
    chat = _prepare_messages(messages)
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
            raise ChatTemplateError("tools: expected a list of JSON schema objects")
        tools = _plain(list(tools), "tools")
    if documents is not None:
        if not isinstance(documents, (list, tuple)) or not all(isinstance(d, Mapping) for d in documents):
            raise ChatTemplateError("documents: expected a list of objects with 'title' and 'text'")
        documents = _plain(list(documents), "documents")
    variables = {**_plain(dict(special_tokens or {}), "special tokens"), **_plain(kwargs, "template variables")}

    final_text = None
    if continue_final_message:
        key = continue_final_message if isinstance(continue_final_message, str) else "content"
        final_text = chat[-1].get(key)
        if final_text is None:
            raise ChatTemplateError(f"continue_final_message: the last message has no '{key}' to continue")
        keys = [k for k in REASONING_FIELDS if chat[-1].get(k) == final_text] if key in REASONING_FIELDS else [key]
        if not any(k in source for k in keys):
            raise ChatTemplateError(f"continue_final_message: the {where} never reads '{key}'")
        if isinstance(final_text, (list, tuple)):
            for block in reversed(final_text):
                if isinstance(block, dict) and "text" in block:
                    final_text = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ChatTemplateError("continue_final_message: the last message has no text block to continue")
        else:
            for k in keys:
                chat[-1][k] = chat[-1][k] + _CONTINUE_TAG

    try:
        template = _compiled(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: syntax error on line {e.lineno}: {e.message}") from None
    try:
        text = template.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **variables)
    except _TemplateRaised as e:
        raise ChatTemplateError(f"{where} refused the conversation: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"{where} failed: {type(e).__name__}: {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, RecursionError) as e:
        raise ChatTemplateError(f"{where} failed: {type(e).__name__}: {e}") from None

    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if str(final_text).strip() not in text or tag not in text:
            raise ChatTemplateError(f"continue_final_message: the {where} does not render the last message as "
                                    "given (it drops or rewrites part of it), so it cannot be continued")
        at = text.rindex(tag)
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
