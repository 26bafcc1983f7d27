"""chat: a checkpoint's chat formatting — its chat template(s) and named special tokens read from the
model folder the way Hugging Face tokenizers read them, and the token ids that end a chat turn;
`ChatFormat.render` picks a template and hands the conversation to serve.chat_template.

Where a folder's template comes from (as HF loads a tokenizer): `chat_template.jinja` (the default
template) and `additional_chat_templates/<name>.jinja` (named ones) when those files exist; otherwise
`tokenizer_config.json`'s `chat_template`, a string or a list of `{"name", "template"}` entries;
otherwise a legacy `chat_template.json` (`{"chat_template": ...}`). With several named templates, a
request with tools uses `tool_use` when there is one, else `default`.

One difference from a `transformers` tokenizer, on purpose: a folder whose tokenizer config names no
`eos_token`/`bos_token` (the shipped small model has no tokenizer config at all) gets them from
`generation_config.json`/`config.json`'s ids, so templates and stop tokens see the model's real EOS.

Errors are `ChatTemplateError` (serve.chat_template's) and name the folder and the problem: no template,
no template of the name asked for, a config file that is not JSON of the expected shape."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from ninfer_gen.serve.chat_template import ChatTemplateError, render_chat_template

# Token names a tokenizer passes to its template (HF's SPECIAL_TOKENS_ATTRIBUTES); any other `*_token`
# string in the tokenizer config and the entries of a dict `extra_special_tokens` are passed as well.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TURN_END_TOKEN = "<|im_end|>"             # ChatML's end of turn: a chat stop token wherever the tokenizer has it


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
