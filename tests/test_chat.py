"""Chat formatting (ninfer_gen.serve.chat, ninfer_gen.serve.chat_template) against transformers'
apply_chat_template on tiny tokenizers and the shipped small model's template; the incremental output parser
(ninfer_gen.serve.parsing) fed every 2-piece and character-by-character split of its inputs, well-formed and
malformed."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from ninfer_gen.serve.chat import load_chat_format
from ninfer_gen.serve.chat_template import ChatTemplateError, render_chat_template
from ninfer_gen.serve.parsing import (ContentDelta, OutputParser, ReasoningDelta, ToolCall, ToolCallArgumentsDelta,
                                      ToolCallEnd, ToolCallInvalid, ToolCallStart, coalesce, collect, parse_output,
                                      prompt_opens_thinking)

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "models" / "qwen3.8-small-py"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city <today> & tomorrow, °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]

# The conversations every template is rendered with (keyword arguments of apply_chat_template).
CONVERSATIONS = {
    "single user, generation prompt": dict(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True),
    "system, multi-turn, no generation prompt": dict(messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "and now, in ünïcode?"}]),
    "thinking off": dict(messages=[{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                         enable_thinking=False),
    "thinking on, reasoning in history": dict(messages=[
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add them"},
        {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "<think>\nsum\n</think>\n\n6"}], enable_thinking=True),
    "tools, calls and results": dict(messages=[
        {"role": "system", "content": "You help."}, {"role": "user", "content": "Weather in Paris and Köln?"},
        {"role": "assistant", "content": None, "reasoning_content": "two calls",
         "tool_calls": [{"id": "a", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                        {"id": "b", "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Köln", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "18 °C"},
        {"role": "tool", "tool_call_id": "b", "content": "12 °C"}], tools=TOOLS, add_generation_prompt=True),
    "tools without a system message, list content": dict(messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather "}, {"type": "text", "text": "in Rome?"}]}],
        tools=TOOLS, add_generation_prompt=True, enable_thinking=False),
}

# A template that exercises the environment rather than a chat format: whitespace control without
# dashes (trim_blocks/lstrip_blocks), special tokens, tojson's options, loop controls, namespace, the
# generation block, strftime_now, reasoning aliases and raise_exception.
FEATURES_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role not in ['system', 'user', 'assistant', 'tool'] %}
        {{ raise_exception('bad role ' + m.role) }}
    {% endif %}
    {% set ns.n = ns.n + 1 %}
    <{{ m.role }}>
    {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}
    {% if m.reasoning_content is defined %}[reasoning: {{ m.reasoning_content }} / {{ m.thinking }}]{% endif %}
    {% if m.tool_calls is defined %}{{ m.tool_calls | tojson(indent=2) }}{% endif %}
    {{ eos_token }}
    {% if ns.n >= 4 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}{{ tools | tojson(separators=(',', ':'), sort_keys=True) }}{% endif %}
{{ dict(a=1) | tojson }} {{ strftime_now('%Y') }}
{% if add_generation_prompt %}<assistant>{% endif %}
"""

CHATML_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
                   "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TOOL_USE_TEMPLATE = "TOOLS {{ (tools or []) | length }} {{ messages | length }}{{ eos_token }}"


def _hf_fast(tokenizer_file=None, **kwargs):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_file=tokenizer_file, **kwargs)


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    words = ["[UNK]", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "hi", "hello", "user", "assistant"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return tok


def _save_tiny(folder: Path, chat_template) -> Path:
    """A tokenizer folder as transformers writes it (tokenizer.json, tokenizer_config.json, chat_template.jinja
    or additional_chat_templates/)."""
    hf = _hf_fast(tokenizer_object=_tiny_tokenizer(), bos_token="<s>", eos_token="<|endoftext|>",
                  unk_token="[UNK]", pad_token="<|endoftext|>", chat_template=chat_template)
    hf.save_pretrained(folder)
    return folder


def _hf_render(hf, conversation) -> str:
    kwargs = dict(conversation)
    return hf.apply_chat_template(kwargs.pop("messages"), tokenize=False, **kwargs)


# --------------------------------------------------------------------------------------- rendering


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_small_model_template_renders_as_transformers(name):
    """The shipped template of the small model, rendered here and by transformers, for each conversation."""
    fmt = load_chat_format(SMALL)
    hf = _hf_fast(str(SMALL / "tokenizer.json"), chat_template=fmt.templates["default"])
    assert fmt.render(**CONVERSATIONS[name]) == _hf_render(hf, CONVERSATIONS[name])


def test_small_model_chat_format():
    """The small model's template, special tokens and stop tokens: its tokenizer has <|endoftext|> (id 0)
    and no <|im_start|>/<|im_end|>, so each turn ends with <|endoftext|>, one token, the chat stop token."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(SMALL / "tokenizer.json"))
    assert tok.token_to_id("<|im_end|>") is None and tok.token_to_id("<|im_start|>") is None
    fmt = load_chat_format(SMALL)
    assert fmt.special_tokens["eos_token"] == "<|endoftext|>" and fmt.stop_token_ids == frozenset({0})
    conv = CONVERSATIONS["system, multi-turn, no generation prompt"]
    prompt = fmt.render(**conv, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and not prompt_opens_thinking(prompt)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    assert ids[0] == 0 and ids.count(0) == 1 + len(conv["messages"])     # the start, then one per turn
    thinking_off = fmt.render(**CONVERSATIONS["thinking off"])
    assert thinking_off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]: unknown role \"robot\""):
        fmt.render([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]: this model takes text only"):
        fmt.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_features_template_renders_as_transformers(tmp_path):
    """Whitespace control, special tokens, tojson options, loop controls, namespace, the generation block,
    strftime_now and reasoning aliases, from a folder transformers saved (tokenizer_config.json and
    chat_template.jinja), loaded by both."""
    from transformers import AutoTokenizer
    folder = _save_tiny(tmp_path / "tok", FEATURES_TEMPLATE)
    assert (folder / "chat_template.jinja").is_file()
    hf = AutoTokenizer.from_pretrained(folder)
    fmt = load_chat_format(folder)
    assert fmt.special_tokens["bos_token"] == "<s>" and fmt.special_tokens["eos_token"] == "<|endoftext|>"
    assert fmt.stop_token_ids == frozenset({2, 4})            # eos and <|im_end|>, which this tokenizer has
    conversations = [*CONVERSATIONS.values(), dict(messages=[
        {"role": "user", "content": "<b>ü</b>"}, {"role": "assistant", "content": "a", "thinking": "t"},
        {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}, {"role": "user", "content": "cut"}],
        add_generation_prompt=True)]
    for conv in conversations:
        assert fmt.render(**conv) == _hf_render(hf, conv)
    bad = [{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]
    with pytest.raises(Exception, match="bad role robot"):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ChatTemplateError, match=r"chat template 'default' of .*tok refused the conversation: "
                                                r"bad role robot"):
        fmt.render(bad)


def test_continue_final_message_as_transformers(tmp_path):
    """An assistant prefill left open (Anthropic's prefill): the same text as transformers."""
    from transformers import AutoTokenizer
    folder = _save_tiny(tmp_path / "tok", CHATML_TEMPLATE)
    hf = AutoTokenizer.from_pretrained(folder)
    fmt = load_chat_format(folder)
    conv = dict(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}],
                continue_final_message=True)
    assert fmt.render(**conv) == _hf_render(hf, conv)
    assert fmt.render(**conv).endswith("<|im_start|>assistant\nSure, ")
    with pytest.raises(ChatTemplateError, match="exclude each other"):
        fmt.render(**conv, add_generation_prompt=True)


def test_named_templates_from_tokenizer_config(tmp_path):
    """tokenizer_config.json's list of named templates: `tool_use` for a request with tools, `default`
    otherwise, or one by name — as transformers chooses."""
    from transformers import AutoTokenizer
    folder = _save_tiny(tmp_path / "tok", None)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": CHATML_TEMPLATE},
                               {"name": "tool_use", "template": TOOL_USE_TEMPLATE}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    hf = AutoTokenizer.from_pretrained(folder)
    fmt = load_chat_format(folder)
    assert set(fmt.templates) == {"default", "tool_use"}
    msgs = [{"role": "user", "content": "hi"}]
    for kwargs in (dict(), dict(tools=TOOLS), dict(chat_template="tool_use")):
        ours = dict(kwargs)
        if "chat_template" in ours:
            ours["template"] = ours.pop("chat_template")
        assert fmt.render(msgs, **ours) == hf.apply_chat_template(msgs, tokenize=False, **kwargs)
    assert fmt.render(msgs, tools=TOOLS) == "TOOLS 1 1<|endoftext|>"
    with pytest.raises(ChatTemplateError, match="no chat template named 'chatml'.*default, tool_use"):
        fmt.render(msgs, template="chatml")
    config["chat_template"] = [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="several chat templates and none named 'default'"):
        load_chat_format(folder).render(msgs)
    config["chat_template"] = CHATML_TEMPLATE                      # a plain string
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_chat_format(folder).render(msgs) == "<|im_start|>user\nhi<|im_end|>\n"


def test_template_files_take_priority_and_additional_templates(tmp_path):
    folder = _save_tiny(tmp_path / "tok", {"default": CHATML_TEMPLATE, "tool_use": TOOL_USE_TEMPLATE})
    assert (folder / "additional_chat_templates" / "tool_use.jinja").is_file()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = "IGNORED"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    fmt = load_chat_format(folder)
    assert fmt.templates == {"default": CHATML_TEMPLATE, "tool_use": TOOL_USE_TEMPLATE}


def test_errors_name_the_problem(tmp_path):
    folder = tmp_path / "none"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text('{"eos_token": {"content": "</s>", "special": true}}')
    fmt = load_chat_format(folder)
    assert fmt.special_tokens == {"eos_token": "</s>"}
    with pytest.raises(ChatTemplateError, match=r"none has no chat template .*cannot format chat requests"):
        fmt.render([{"role": "user", "content": "hi"}])
    (folder / "chat_template.jinja").write_text("ok\n{% for m in messages %}{{ m.content }")
    with pytest.raises(ChatTemplateError, match=r"chat template 'default' of .*none: syntax error on line 2"):
        load_chat_format(folder).render([{"role": "user", "content": "hi"}])
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ChatTemplateError, match=r"tokenizer_config.json: cannot read it as JSON"):
        load_chat_format(folder)
    with pytest.raises(ChatTemplateError, match="the conversation is empty"):
        render_chat_template(CHATML_TEMPLATE, [])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\.content: a set is not JSON data"):
        render_chat_template(CHATML_TEMPLATE, [{"role": "user", "content": {"a"}}])
    with pytest.raises(ChatTemplateError, match=r"failed: UndefinedError: .*'nope' is undefined"):
        render_chat_template("{{ nope.x }}", [{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="underscore attribute '_x'"):
        render_chat_template("{% set ns = namespace(_x=1) %}", [{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        render_chat_template("{{ messages.__class__.__mro__ }}", [{"role": "user", "content": "hi"}])


def test_render_never_touches_the_callers_messages():
    msgs = [{"role": "user", "content": "hi", "reasoning": "r", "tool_calls": None}]
    before = json.dumps(msgs)
    out = render_chat_template("{{ messages[0].reasoning_content }}|{{ messages[0].tool_calls is defined }}", msgs)
    assert out == "r|False" and json.dumps(msgs) == before


# ------------------------------------------------------------------------------------------ parsing


def _events(pieces, **options) -> list:
    parser = OutputParser(**options)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return coalesce(events + parser.finish())


def _every_split(text: str, **options) -> list:
    """The events of `text` whole; asserts every 2-piece split and the char-by-char feed give the same."""
    whole = _events([text], **options)
    for i in range(1, len(text)):
        assert _events([text[:i], text[i:]], **options) == whole, f"split at {i}: {text[:i]!r} | {text[i:]!r}"
    assert _events(list(text), **options) == whole, "fed character by character"
    assert collect(whole) == parse_output(text, **options)
    return whole


def _call(index, name, args_json):
    return [ToolCallStart(index, name), ToolCallArgumentsDelta(index, args_json),
            ToolCallEnd(index, ToolCall(name, json.loads(args_json), args_json))]


WEATHER = '{"city": "Paris", "note": "a \\"<q>\\" \\u00e9 </tool_call>", "days": [1, -2.5e3, true, null, {}]}'

PARSER_CASES = [
    ("reasoning, content, two JSON calls",
     '<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
     + WEATHER + '}\n</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>', {},
     [ReasoningDelta("The user wants weather."), ContentDelta("Let me check."), *_call(0, "get_weather", WEATHER),
      *_call(1, "now", "{}")]),
    ("the prompt opened <think>", "I should answer.\n</think>\n\n42 <b>bold</b>", dict(starts_in_reasoning=True),
     [ReasoningDelta("I should answer."), ContentDelta("42 <b>bold</b>")]),
    ("no reasoning; angle brackets and a late <think> are content", "a < b and <think> x </think> <tool", {},
     [ContentDelta("a < b and <think> x </think> <tool")]),
    ("thinking disabled: tags are content", "<think>x</think>\nanswer", dict(thinking=False),
     [ContentDelta("<think>x</think>\nanswer")]),
    ("tool calls not parsed", 'ok <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>',
     dict(parse_tool_calls=False), [ContentDelta('ok <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>')]),
    ("cut-off thought stays reasoning", "<think>\nstill thinking </thi", {}, [ReasoningDelta("still thinking </thi")]),
    ("'parameters' for 'arguments', extra keys ignored, no arguments",
     '<tool_call>{"name":"f","parameters":{"a":[1,{"b":"c"}]},"id":7}</tool_call>'
     '<tool_call>{"name": "g"}</tool_call>', {},
     [*_call(0, "f", '{"a":[1,{"b":"c"}]}'), *_call(1, "g", "{}")]),
]

BAD_CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1 "b": 2}}\n</tool_call>'
MALFORMED_CASES = [
    ("bad JSON after the name: the started call is abandoned",
     "Hi\n" + BAD_CALL + "\nBye",
     [ContentDelta("Hi"), ToolCallStart(0, "f"), ToolCallArgumentsDelta(0, '{"a": 1 '),
      ToolCallInvalid(0, "unexpected '\"' in the tool call's JSON", '<tool_call>\n{"name": "f", "arguments": {"a": 1 '),
      ContentDelta(BAD_CALL + "\nBye")]),
    ("unclosed <tool_call> at the end", 'x<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_ca',
     [ContentDelta("x"), ToolCallStart(0, "f"), ToolCallArgumentsDelta(0, '{"a": 1}'),
      ToolCallInvalid(0, "unclosed <tool_call> at the end of the output",
                      '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_ca'),
      ContentDelta('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_ca')]),
    ("an array is not a call", '<tool_call>\n["f"]\n</tool_call> then',
     [ToolCallInvalid(None, "a tool call is a JSON object or <function=…>", "<tool_call>\n"),
      ContentDelta('<tool_call>\n["f"]\n</tool_call> then')]),
    ("a call without a name", '<tool_call>{"arguments": {}}</tool_call>',
     [ToolCallInvalid(None, "the tool call has no name", '<tool_call>{"arguments": {}}'),
      ContentDelta('<tool_call>{"arguments": {}}</tool_call>')]),
    ("a name that is not a string", '<tool_call>{"name": 3}</tool_call>',
     [ToolCallInvalid(None, "the tool call's name is not a string", '<tool_call>{"name": '),
      ContentDelta('<tool_call>{"name": 3}</tool_call>')]),
    ("arguments that are not an object", '<tool_call>{"name": "f", "arguments": "{}"}</tool_call>',
     [ToolCallStart(0, "f"), ToolCallInvalid(0, "the tool call's arguments is not a JSON object",
                                             '<tool_call>{"name": "f", "arguments": '),
      ContentDelta('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>')]),
    ("text between the object and </tool_call>", '<tool_call>{"name": "f"} oops</tool_call>',
     [ToolCallStart(0, "f"), ToolCallInvalid(0, "text after the tool call's JSON object", '<tool_call>{"name": "f"} '),
      ContentDelta('<tool_call>{"name": "f"} oops</tool_call>')]),
    ("a duplicate key", '<tool_call>{"name": "f", "name": "g"}</tool_call>',
     [ToolCallStart(0, "f"), ToolCallInvalid(0, "the tool call has the key 'name' twice",
                                             '<tool_call>{"name": "f", "name'),
      ContentDelta('<tool_call>{"name": "f", "name": "g"}</tool_call>')]),
    ("an invalid number", '<tool_call>{"name": "f", "arguments": {"a": 01}}</tool_call>',
     [ToolCallStart(0, "f"), ToolCallArgumentsDelta(0, '{"a": 01'),
      ToolCallInvalid(0, "invalid JSON number '01'", '<tool_call>{"name": "f", "arguments": {"a": 01'),
      ContentDelta('<tool_call>{"name": "f", "arguments": {"a": 01}}</tool_call>')]),
    ("a call opened and nothing else", "<tool_call>  ",
     [ToolCallInvalid(None, "unclosed <tool_call> at the end of the output", "<tool_call>  "),
      ContentDelta("<tool_call>  ")]),
    ("a malformed call, then a good one",
     '<tool_call>nope</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
     [ToolCallInvalid(None, "a tool call is a JSON object or <function=…>", "<tool_call>"),
      ContentDelta("<tool_call>nope</tool_call>"), *_call(0, "g", "{}")]),
]

XML_TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "text": {"type": "string"}, "mode": {"type": "integer"},
    "force": {"type": ["boolean", "null"]}, "meta": {"type": "object"}}}}}]
XML_CALL = ('<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a "b".py\n</parameter>\n'
            '<parameter=text>\n\ndef f():\n    return "<x>"\n\n</parameter>\n<parameter=mode>\n420\n</parameter>\n'
            '<parameter=force>\ntrue\n</parameter>\n<parameter=meta>\n{"k": [1]}\n</parameter>\n'
            '<parameter=other>\nplain words\n</parameter>\n</function>\n</tool_call>')
XML_ARGS = {"path": '/tmp/a "b".py', "text": '\ndef f():\n    return "<x>"\n', "mode": 420, "force": True,
            "meta": {"k": [1]}, "other": "plain words"}


@pytest.mark.parametrize("name,text,options,expected", PARSER_CASES, ids=[c[0] for c in PARSER_CASES])
def test_parser_same_events_for_every_split(name, text, options, expected):
    assert _every_split(text, **options) == expected


@pytest.mark.parametrize("name,text,expected", MALFORMED_CASES, ids=[c[0] for c in MALFORMED_CASES])
def test_malformed_markup_is_content(name, text, expected):
    events = _every_split(text)
    assert events == expected
    out = collect(events)
    assert out.tool_calls == [e.call for e in expected if isinstance(e, ToolCallEnd)]


def test_xml_tool_calls_typed_by_schema():
    """Qwen3.5's XML markup: parameters typed by the tool's schema (strings kept as written, without the
    newlines around them), untyped ones read as JSON where they parse."""
    events = _every_split("Writing it.\n" + XML_CALL, tools=XML_TOOLS)
    assert events[:2] == [ContentDelta("Writing it."), ToolCallStart(0, "write_file")]
    end = events[-1]
    assert isinstance(end, ToolCallEnd) and end.call.arguments == XML_ARGS
    assert json.loads(end.call.arguments_json) == XML_ARGS and events[2].text == end.call.arguments_json
    untyped = parse_output(XML_CALL).tool_calls[0].arguments              # no schema: JSON where it parses
    assert untyped["mode"] == 420 and untyped["path"] == '/tmp/a "b".py' and untyped["text"] == XML_ARGS["text"]
    odd = parse_output('<tool_call><function=f><parameter=n>1e400</parameter><parameter=m>NaN</parameter>'
                       '<parameter=e></parameter></function></tool_call>').tool_calls[0]
    assert odd.arguments == {"n": "1e400", "m": "NaN", "e": ""}            # not JSON numbers: kept as text
    assert json.loads(odd.arguments_json) == odd.arguments
    bad = '<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n<oops>\n</function>\n</tool_call>'
    out = _every_split(bad)
    assert out[:3] == [ToolCallStart(0, "f"), ToolCallArgumentsDelta(0, '{"a": 1'),
                       ToolCallInvalid(0, "expected <parameter=…> or </function> in the tool call",
                                       '<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n')]
    assert collect(out).content == bad and not collect(out).tool_calls


def test_arguments_stream_before_the_call_closes():
    """Name as soon as its string closes, argument text as generated (JSON), string parameters as
    generated (XML); a tag split across deltas leaks nothing into content."""
    parser = OutputParser()
    assert parser.feed("Sure.\n<tool_") == [ContentDelta("Sure.")]
    assert parser.feed('call>\n{"name": "get_wea') == []
    assert parser.feed('ther", "arguments": {"city": "Par') == [
        ToolCallStart(0, "get_weather"), ToolCallArgumentsDelta(0, '{"city": "Par')]
    assert parser.feed('is"}}\n</tool_call>') == [ToolCallArgumentsDelta(0, 'is"}'),
                                                   ToolCallEnd(0, ToolCall("get_weather", {"city": "Paris"},
                                                                           '{"city": "Paris"}'))]
    assert parser.finish() == []

    parser = OutputParser(tools=XML_TOOLS)
    cut = XML_CALL.index("return") + 3
    streamed = coalesce(parser.feed(XML_CALL[:cut]))
    assert streamed[-1] == ToolCallArgumentsDelta(0, '{"path": "/tmp/a \\"b\\".py", "text": "\\ndef f():\\n    ret')
    assert parser.feed("") == []

    parser = OutputParser(starts_in_reasoning=True)
    assert parser.feed("think\n\n</th") == [ReasoningDelta("think")]
    assert parser.feed("ink>\n\nHi <tool") == [ContentDelta("Hi")]
    assert parser.finish() == [ContentDelta(" <tool")]


def test_random_markup_never_raises_and_is_split_invariant():
    """Random mixtures of markup fragments: no exception, the same events for a few random splits and
    char by char, argument deltas that spell each finished call's arguments, abandoned calls never finish."""
    fragments = ["<think>", "</think>", "<tool_call>", "</tool_call>", "\n", " ", "{", "}", "[", "]", ":", ",",
                 '"name"', '"arguments"', '"f"', "1", "-0.5e2", "true", "null", '"a\\"b"', "\\", "x", "é", "<",
                 "<function=f>", "<parameter=p>", "</parameter>", "</function>", "</tool", "<think"]
    rng = random.Random(1234)
    for _ in range(150):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 25)))
        options = dict(starts_in_reasoning=rng.random() < 0.3, thinking=rng.random() < 0.8)
        whole = _events([text], **options)
        cuts = sorted(rng.sample(range(len(text) + 1), min(3, len(text) + 1)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _events(pieces, **options) == whole and _events(list(text), **options) == whole, text
        args: dict[int, str] = {}
        abandoned = set()
        for e in whole:
            if isinstance(e, ToolCallArgumentsDelta):
                args[e.index] = args.get(e.index, "") + e.text
            elif isinstance(e, ToolCallInvalid) and e.index is not None:
                abandoned.add(e.index)
            elif isinstance(e, ToolCallEnd):
                assert e.index not in abandoned and args[e.index] == e.call.arguments_json
                assert json.loads(e.call.arguments_json) == e.call.arguments


def test_well_formed_calls_survive_random_splits():
    """A long, well-formed answer fed in random pieces gives the answer that the whole text gives."""
    text = ("<think>\nplan\n</think>\n\nText before.\n" + "\n".join(
        f'<tool_call>\n{{"name": "t{i}", "arguments": {{"i": {i}, "s": "{"x" * i}"}}}}\n</tool_call>' for i in range(8))
        + "\n" + XML_CALL)
    want = parse_output(text, tools=XML_TOOLS)
    assert want.reasoning == "plan" and want.content == "Text before." and len(want.tool_calls) == 9
    rng = random.Random(7)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 60)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert collect(_events(pieces, tools=XML_TOOLS)) == want


def test_prompt_opens_thinking_and_end_to_end_with_the_small_model():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    fmt = load_chat_format(SMALL)
    prompt = fmt.render([{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS, add_generation_prompt=True)
    parser = OutputParser.for_prompt(prompt, tools=TOOLS)
    output = ('<think>\nCall the tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
              '\n</tool_call>')
    events = coalesce([e for c in output for e in parser.feed(c)] + parser.finish())
    assert events == [ReasoningDelta("Call the tool."), *_call(0, "get_weather", '{"city": "Paris"}')]
    # the answer goes back into the next prompt the way the model wrote it
    call = events[-1].call
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "reasoning_content": "Call the tool.",
                "tool_calls": [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}]
    assert (prompt + output + "<|endoftext|>") == fmt.render(history, tools=TOOLS)
