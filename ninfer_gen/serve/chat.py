"""chat: a checkpoint's chat formatting — its chat template(s) and named special tokens read from the
model folder the way Hugging Face tokenizers read them, conversations rendered with the semantics of
`transformers`' `apply_chat_template(..., tokenize=False)`, and the token ids that end a chat turn.

Where a folder's template comes from (as HF loads a tokenizer): `chat_template.jinja` (the default
template) and `additional_chat_templates/<name>.jinja` (named ones) when those files exist; otherwise
`tokenizer_config.json`'s `chat_template`, a string or a list of `{"name", "template"}` entries;
otherwise a legacy `chat_template.json` (`{"chat_template": ...}`). With several named templates, a
request with tools uses `tool_use` when there is one, else `default`.

Rendering, as `transformers` does it: a sandboxed (immutable) Jinja environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension and the `{% generation %}` block (rendered as its body),
`raise_exception(msg)`, `strftime_now(fmt)`, a `tojson` filter that does not escape HTML and writes
non-ASCII as is (`ensure_ascii=False`, with `indent`, `separators`, `sort_keys`), a `namespace` that
refuses underscore attributes; the variables `messages`, `tools`, `documents`, `add_generation_prompt`,
the named special tokens (`bos_token`, `eos_token`, …) and any extra keyword (`enable_thinking`, …,
which overrides a special token of the same name). Message keys whose value is None are dropped, and a
message's reasoning given as `reasoning_content`, `thinking` or `reasoning` is visible under the first
two names. `continue_final_message` leaves the last message open for the model to continue.

One difference from a `transformers` tokenizer, on purpose: a folder whose tokenizer config names no
`eos_token`/`bos_token` (the shipped small model has no tokenizer config at all) gets them from
`generation_config.json`/`config.json`'s ids, so templates and stop tokens see the model's real EOS.

Errors are `ChatTemplateError` (a ValueError; a server answers them with a 4xx) and name the template,
its folder and the problem: no template, a syntax error and its line, `raise_exception`'s message, an
undefined variable, a message that is not JSON data."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Token names a tokenizer passes to its template (HF's SPECIAL_TOKENS_ATTRIBUTES); any other `*_token`
# string in the tokenizer config and the entries of a dict `extra_special_tokens` are passed as well.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TURN_END_TOKEN = "<|im_end|>"             # ChatML's end of turn: a chat stop token wherever the tokenizer has it
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


# ---------------------------------------------------------------------------------------- the folder


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ChatTemplateError(f"{path}: cannot read it as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _tokenizer_config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return _read_json(path) if path.is_file() else {}


def _token_text(value) -> str | None:
    """A special token as a tokenizer config stores it: a string, or an AddedToken object with `content`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _config_templates(config: dict, path: Path) -> dict[str, str]:
    value = config.get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):
        out = {}
        for i, entry in enumerate(value):
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ChatTemplateError(f"{path}: chat_template[{i}] must be an object with a string 'name' and "
                                        "a string 'template'")
            out[entry["name"]] = entry["template"]
        return out
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    raise ChatTemplateError(f"{path}: chat_template must be a string or a list of named templates, "
                            f"got {type(value).__name__}")


def _read_templates(folder: Path, config: dict) -> dict[str, str]:
    files = {}
    if (folder / "chat_template.jinja").is_file():
        files["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    extra = folder / "additional_chat_templates"
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            files[path.stem] = path.read_text(encoding="utf-8")
    if files:                    # template files take priority over the tokenizer config's entries (as HF)
        return files
    templates = _config_templates(config, folder / "tokenizer_config.json")
    if not templates and (folder / "chat_template.json").is_file():
        legacy = _read_json(folder / "chat_template.json").get("chat_template")
        if not isinstance(legacy, str):
            raise ChatTemplateError(f"{folder / 'chat_template.json'}: 'chat_template' must be a string")
        templates = {"default": legacy}
    return templates


def _config_ids(folder: Path, key: str) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        if not (folder / name).is_file():
            continue
        data = _read_json(folder / name)
        for source in (data, data.get("text_config") if isinstance(data.get("text_config"), dict) else {}):
            value = source.get(key)
            for i in value if isinstance(value, list) else [] if value is None else [value]:
                if isinstance(i, int) and not isinstance(i, bool) and i not in ids:
                    ids.append(i)
    return ids


def _load_tokenizer(folder: Path):
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:                    # tokenizers raises its own exception type
        raise ChatTemplateError(f"{path}: cannot load the tokenizer: {e}") from None


def _special_tokens(folder: Path, config: dict, tokenizer) -> dict[str, str]:
    tokens: dict[str, str] = {}
    for key, value in config.items():
        if key in SPECIAL_TOKEN_NAMES or key.endswith("_token"):
            text = _token_text(value)
            if text is not None:
                tokens[key] = text
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        for key, value in extra.items():
            if _token_text(value) is not None:
                tokens[key] = _token_text(value)
    if (folder / "special_tokens_map.json").is_file():            # the legacy file fills what the config lacks
        for key, value in _read_json(folder / "special_tokens_map.json").items():
            if key not in tokens and (key in SPECIAL_TOKEN_NAMES or key.endswith("_token")):
                text = _token_text(value)
                if text is not None:
                    tokens[key] = text
    if tokenizer is not None:                  # no config names them: the model config's ids, as text
        for key, id_key in (("eos_token", "eos_token_id"), ("bos_token", "bos_token_id")):
            ids = _config_ids(folder, id_key)
            if key not in tokens and ids and tokenizer.id_to_token(ids[0]) is not None:
                tokens[key] = tokenizer.id_to_token(ids[0])
    return tokens


@dataclass(frozen=True)
class ChatFormat:
    """A model's chat formatting: its templates by name, its named special tokens, its chat stop tokens."""
    source: str                                        # where it was read from (for messages)
    templates: Mapping[str, str]
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    stop_token_ids: frozenset[int] = frozenset()

    def template(self, name: str | None = None, tools=None) -> tuple[str, str]:
        """(name, text) of the template a request uses: `name` when given, else `tool_use` for a request with
        tools where there is one, else `default` (or the only template)."""
        if not self.templates:
            raise ChatTemplateError(f"{self.source} has no chat template (no chat_template.jinja, no chat_template "
                                    "in tokenizer_config.json): it cannot format chat requests")
        if name is not None:
            if name not in self.templates:
                raise ChatTemplateError(f"{self.source} has no chat template named '{name}' "
                                        f"(it has: {', '.join(sorted(self.templates))})")
            return name, self.templates[name]
        if tools is not None and "tool_use" in self.templates:
            return "tool_use", self.templates["tool_use"]
        if "default" in self.templates:
            return "default", self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.items()))
        raise ChatTemplateError(f"{self.source} has several chat templates and none named 'default' "
                                f"({', '.join(sorted(self.templates))}): name the one to use")

    def render(self, messages, tools=None, *, add_generation_prompt: bool = False,
               enable_thinking: bool | None = None, continue_final_message: bool | str = False, documents=None,
               template: str | None = None, **kwargs) -> str:
        """The prompt text of a conversation. `enable_thinking` is passed to the template only when set
        (Qwen templates read `enable_thinking is false` as the switch that turns thinking off)."""
        name, source = self.template(template, tools)
        if enable_thinking is not None:
            kwargs["enable_thinking"] = bool(enable_thinking)
        return render_chat_template(source, messages, tools, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, documents=documents,
                                    special_tokens=self.special_tokens,
                                    where=f"chat template '{name}' of {self.source}", **kwargs)


def chat_stop_token_ids(folder: str | Path, tokenizer=None, special_tokens: Mapping[str, str] | None = None
                        ) -> frozenset[int]:
    """Token ids that end a chat turn: the model's EOS ids (generation_config.json, config.json), the id of
    the tokenizer's `eos_token`, and `<|im_end|>`'s id when the tokenizer has that token. `tokenizer`:
    an HF `tokenizers.Tokenizer` (loaded from the folder's tokenizer.json when not given)."""
    folder = Path(folder)
    if tokenizer is None:
        tokenizer = _load_tokenizer(folder)
    ids = set(_config_ids(folder, "eos_token_id"))
    if tokenizer is not None:
        if special_tokens is None:
            special_tokens = _special_tokens(folder, _tokenizer_config(folder), tokenizer)
        for text in (special_tokens.get("eos_token"), TURN_END_TOKEN):
            if text is not None and tokenizer.token_to_id(text) is not None:
                ids.add(tokenizer.token_to_id(text))
    return frozenset(ids)


def load_chat_format(folder: str | Path) -> ChatFormat:
    """The chat formatting of a model folder (an HF checkpoint or a converted one, which keeps the
    tokenizer files). A folder without a template loads (its `template()` and `render()` then raise
    a ChatTemplateError that says so), so a completions-only server can still start."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ChatTemplateError(f"{folder}: not a model folder")
    config = _tokenizer_config(folder)
    tokenizer = _load_tokenizer(folder)
    tokens = _special_tokens(folder, config, tokenizer)
    return ChatFormat(source=str(folder), templates=_read_templates(folder, config), special_tokens=tokens,
                      stop_token_ids=chat_stop_token_ids(folder, tokenizer, tokens))
