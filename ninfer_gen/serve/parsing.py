"""parsing: a chat model's output text split into reasoning, content and tool calls, incrementally —
`OutputParser` is fed the decoded text deltas as tokens stream and returns events; fed the whole text
at once (`parse_output`) it returns the same events, merged, so a streamed answer and a non-streamed one
say the same thing.

What it recognises:
- reasoning: the text between `<think>` and `</think>` at the start of the output, or from the start
  when the prompt already opened `<think>` (`starts_in_reasoning`; `prompt_opens_thinking(prompt)`
  tells). Newlines around the reasoning and before the content that follows are dropped. An unclosed
  `<think>` at the end of the output stays reasoning (a cut-off thought). `thinking=False` is the switch
  that disables thinking: no reasoning section, `<think>` is plain content.
- tool calls (`parse_tool_calls=True`), one per `<tool_call>…</tool_call>` in the content, in either of
  Qwen's two markups:
  JSON (Qwen2.5/Qwen3): `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>` ("parameters" is
  read as "arguments"; other keys are ignored). The name is reported as soon as its string closes and the
  arguments are streamed as the model writes them: the deltas are the model's own JSON text of the
  arguments object, validated character by character.
  XML (Qwen3-Coder/Qwen3.5): `<tool_call>\n<function=f>\n<parameter=p>\nvalue\n</parameter>\n</function>
  \n</tool_call>`. The arguments are written as a JSON object `{"p": value, ...}`: a parameter whose
  schema type (from `tools`) is string streams character by character, others are typed by their schema
  (or read as JSON where they parse, else kept as strings) and sent when their `</parameter>` closes.
  Whitespace between calls and before the first call is dropped.
- malformed markup — JSON that breaks, a `<tool_call>` that is neither form, a call without a name, a
  call still open at the end of the output, text between the call and `</tool_call>` — is returned as
  plain content: a `ToolCallInvalid` event, then the markup's raw text as content, then content up to
  and including the next `</tool_call>`. Never an exception. A call whose `ToolCallStart` was already
  sent can still turn out malformed (it is only final at `</tool_call>`); its `ToolCallInvalid` carries
  its index so a server can drop it.
A tag split across deltas is held back until it is decided, so no partial markup reaches content.
Deltas may be any split of the text (a character at a time); `coalesce` merges adjacent text events,
after which every split gives the same events."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"
MAX_NAME_CHARS = 256                       # a function or parameter name longer than this is not markup


# ------------------------------------------------------------------------------------------- events


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int                             # 0, 1, … in the order calls start; never reused
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    text: str                              # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    arguments_json: str                    # the JSON text the argument deltas spelled, in full


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    call: ToolCall


@dataclass(frozen=True)
class ToolCallInvalid:
    index: int | None                      # the started call this abandons; None when none was started
    reason: str
    raw: str                               # the markup so far, which follows as content


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgumentsDelta | ToolCallEnd | ToolCallInvalid


@dataclass
class ParsedOutput:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def coalesce(events) -> list:
    """Adjacent reasoning, content, or same-call argument deltas merged into one event each."""
    out: list = []
    run: list = []                                     # a run of deltas of one kind (and call)

    def close_run():
        if run:
            first = run[0]
            text = "".join(e.text for e in run)
            out.append(ToolCallArgumentsDelta(first.index, text) if isinstance(first, ToolCallArgumentsDelta)
                       else type(first)(text))
            run.clear()

    for e in events:
        if isinstance(e, (ReasoningDelta, ContentDelta, ToolCallArgumentsDelta)):
            if run and (type(run[0]) is not type(e) or getattr(run[0], "index", None) != getattr(e, "index", None)):
                close_run()
            run.append(e)
        else:
            close_run()
            out.append(e)
    close_run()
    return out


def collect(events) -> ParsedOutput:
    """The whole answer: reasoning and content text, and the calls that finished (abandoned ones are not
    calls; their text is in the content)."""
    reasoning, content, calls = [], [], []
    for e in events:
        if isinstance(e, ReasoningDelta):
            reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            content.append(e.text)
        elif isinstance(e, ToolCallEnd):
            calls.append(e.call)
    return ParsedOutput("".join(reasoning), "".join(content), calls)


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` (Qwen3.5 and DeepSeek-R1 templates open it
    for the model), so the output starts in reasoning."""
    return prompt.rstrip().endswith(THINK_OPEN)


def _held(text: str, *tags: str) -> int:
    """Length of the longest end of `text` that could be the start of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


# ---------------------------------------------------------------------------------- JSON tool calls

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?\Z")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_ESCAPES = frozenset('"\\/bfnrtu')
_HEX = frozenset("0123456789abcdefABCDEF")
_WS = frozenset(" \t\n\r")
_LITERALS = {"t": "true", "f": "false", "n": "null"}

# automaton states: expecting a value / a key or '}' / a key / ':' / ',' or a closer / a value or ']';
# inside a string, a number, a literal; the top value complete
_VALUE, _KEY_OR_END, _KEY, _COLON, _AFTER, _VALUE_OR_END, _STRING, _NUMBER_S, _LITERAL, _END = range(10)


class _JsonCall:
    """One `<tool_call>` body in JSON form: validates it character by character (a JSON automaton),
    watches the members of the top object for "name" and "arguments", and streams the arguments. Keeps
    only what it needs (keys, the name, numbers being read, the arguments' text), so a long call costs
    time in proportion to its length however finely it is fed."""

    def __init__(self, parser: OutputParser):
        self.parser = parser
        self.length = 0                    # characters of the body consumed
        self.stack: list[str] = []
        self.state = _VALUE
        self.in_key = False
        self.escape = 0                    # 0: none; 1: after '\'; 2..5: hex digits of \u still due
        self.literal = ""
        self.token: list[str] | None = None    # characters of a top-level key, the name's string, a number
        self.member_key: str | None = None
        self.in_member = False
        self.keys: set[str] = set()
        self.name: str | None = None
        self.index: int | None = None
        self.args_start: int | None = None     # where the arguments' text starts and ends, in the body
        self.args_end: int | None = None
        self.args_pending: list[str] = []      # arguments' text not sent yet (the name is not known yet)
        self.args_text: list[str] = []         # arguments' text sent
        self.closing = ""                  # the `</tool_call>` seen so far after the object

    # -- the automaton ---------------------------------------------------------------------------

    def _value_begins(self, c: str) -> str | None:
        top_member = len(self.stack) == 1 and self.stack[0] == "{"
        if top_member:
            self.in_member = True
            if self.member_key == "name" and c != '"':
                return "the tool call's name is not a string"
            if self.member_key in ("arguments", "parameters"):
                if c != "{":
                    return f"the tool call's {self.member_key} is not a JSON object"
                self.args_start = self.length
        if c == "{":
            self.stack.append("{")
            self.state = _KEY_OR_END
        elif c == "[":
            self.stack.append("[")
            self.state = _VALUE_OR_END
        elif c == '"':
            self.state, self.in_key = _STRING, False
            self.token = [c] if top_member and self.member_key == "name" else None
        elif c in "-0123456789":
            self.state, self.token = _NUMBER_S, [c]
        elif c in _LITERALS:
            self.state, self.literal = _LITERAL, _LITERALS[c][1:]
        else:
            return f"{c!r} cannot start a JSON value"
        return None

    def _value_ends(self) -> str | None:
        """A value ended with the last character consumed (containers: the stack already popped)."""
        if len(self.stack) == 1 and self.in_member:
            self.in_member = False
            if self.member_key == "name":
                try:
                    name = json.loads("".join(self.token))
                except ValueError:
                    return "the tool call's name is not a valid JSON string"
                if not name.strip():
                    return "the tool call's name is empty"
                self.name = name
            elif self.member_key in ("arguments", "parameters"):
                self.args_end = self.length
        self.token = None
        self.state = _AFTER if self.stack else _END
        return None

    def _char(self, c: str) -> str | None:
        """Consumes one character of the body; a reason when it breaks the JSON or the call's shape."""
        s = self.state
        if s == _STRING:
            self.length += 1
            if self.token is not None:
                self.token.append(c)
            if self.escape == 1:
                if c not in _ESCAPES:
                    return f"invalid escape \\{c} in a JSON string"
                self.escape = 5 if c == "u" else 0
            elif self.escape > 1:
                if c not in _HEX:
                    return "invalid \\u escape in a JSON string"
                self.escape = self.escape - 1 if self.escape > 2 else 0
            elif c == "\\":
                self.escape = 1
            elif c == '"':
                if not self.in_key:
                    return self._value_ends()
                if self.token is not None:                 # a key of the top object
                    key = json.loads("".join(self.token))
                    if key in self.keys or (key in ("arguments", "parameters")
                                            and {"arguments", "parameters"} & self.keys):
                        return f"the tool call has the key {key!r} twice"
                    self.keys.add(key)
                    self.member_key = key
                self.token, self.state = None, _COLON
            elif ord(c) < 0x20:
                return "a control character inside a JSON string"
            return None
        if s == _NUMBER_S:
            if c in _NUMBER_CHARS:
                self.length += 1
                self.token.append(c)
                return None
            number = "".join(self.token)
            if not _NUMBER.match(number):
                return f"invalid JSON number {number!r}"
            return self._value_ends() or self._char(c)
        if s == _LITERAL:
            if c != self.literal[0]:
                return "invalid JSON literal"
            self.length += 1
            self.literal = self.literal[1:]
            return None if self.literal else self._value_ends()
        if c in _WS:
            self.length += 1
            return None
        if s == _END:
            return "text after the tool call's JSON object"
        if s in (_VALUE, _VALUE_OR_END) and not (s == _VALUE_OR_END and c == "]"):
            error = self._value_begins(c)
            self.length += 1
            return error
        if s in (_KEY_OR_END, _KEY) and c == '"':
            self.state, self.in_key = _STRING, True
            self.token = [c] if len(self.stack) == 1 else None
            self.length += 1
            return None
        if s == _COLON and c == ":":
            self.length += 1
            self.state = _VALUE
            return None
        if (s == _KEY_OR_END and c == "}") or (s == _VALUE_OR_END and c == "]") \
                or (s == _AFTER and c in "}]"):
            if (c == "}") != (self.stack[-1] == "{"):
                return f"{c!r} closes a JSON {'object' if self.stack[-1] == '{' else 'array'}"
            self.length += 1
            self.stack.pop()
            return self._value_ends()
        if s == _AFTER and c == ",":
            self.length += 1
            self.state = _KEY if self.stack[-1] == "{" else _VALUE
            return None
        return f"unexpected {c!r} in the tool call's JSON"

    # -- driving -----------------------------------------------------------------------------------

    def _scan(self, text: str) -> tuple[int, str | None, bool]:
        for n, c in enumerate(text):
            if self.state == _END and (self.closing or c == "<"):
                self.closing += c
                if not CALL_CLOSE.startswith(self.closing):
                    return n, "text after the tool call's JSON object", False
                if self.closing == CALL_CLOSE:
                    return n + 1, None, True
                continue
            error = self._char(c)
            if error:
                return n, error, False
            if self.state == _END and self.name is None:
                return n + 1, "the tool call has no name", False
        return len(text), None, False

    def feed(self, text: str) -> tuple[int, str | None, bool]:
        """(characters consumed, a reason it is malformed, whether `</tool_call>` closed it). What was
        sent before a break is the same for any split of the text."""
        base = self.length
        used, error, closed = self._scan(text)
        if self.args_start is not None:
            lo = max(self.args_start, base)
            hi = self.args_end if self.args_end is not None else self.length
            if hi > lo:
                self.args_pending.append(text[lo - base:hi - base])
        if self.name is not None and self.index is None:
            self.index = self.parser._start_call(self.name)
        if self.index is not None and self.args_pending:
            piece = "".join(self.args_pending)
            self.args_pending.clear()
            self.args_text.append(piece)
            self.parser._emit(ToolCallArgumentsDelta(self.index, piece))
        if closed:
            error = self._finish()
        return used, error, closed and error is None

    def _finish(self) -> str | None:
        if self.args_start is None:
            self.parser._emit(ToolCallArgumentsDelta(self.index, "{}"))
            self.args_text.append("{}")
        text = "".join(self.args_text)
        try:
            arguments = json.loads(text)
        except (ValueError, RecursionError):
            return "the tool call's arguments are not valid JSON"
        self.parser._emit(ToolCallEnd(self.index, ToolCall(self.name, arguments, text)))
        return None


# ----------------------------------------------------------------------------------- XML tool calls


def _schema_types(tools) -> dict[str, dict[str, str]]:
    """function name → parameter name → JSON schema type, from OpenAI-style or plain tool schemas."""
    out: dict[str, dict[str, str]] = {}
    for tool in tools or ():
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
        params = fn.get("parameters") or fn.get("input_schema") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        if not isinstance(fn.get("name"), str) or not isinstance(props, dict):
            continue
        types = {}
        for key, schema in props.items():
            kind = schema.get("type") if isinstance(schema, dict) else None
            if isinstance(kind, list):
                kind = next((k for k in kind if k != "null"), None)
            if isinstance(kind, str):
                types[key] = kind
        out[fn["name"]] = types
    return out


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows a double")
    return value


def _json_value(text: str):
    """Strict JSON: no NaN/Infinity, no numbers that overflow (their JSON text would not be JSON)."""
    return json.loads(text, parse_constant=_no_constant, parse_float=_finite)


def _typed(value: str, kind: str | None):
    """A parameter's text as its schema type says; JSON where it parses and no type says string."""
    if kind == "string":
        return value
    text = value.strip()
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        if kind in ("integer", "number") and _NUMBER.match(text):
            number = _json_value(text)
            return int(number) if kind == "integer" and float(number).is_integer() else number
        return _json_value(text)
    except (ValueError, RecursionError):
        return value


class _XmlCall:
    """One `<tool_call>` body in XML form, after `<function=`: the name, the parameters one by one."""

    def __init__(self, parser: OutputParser, types: dict[str, dict[str, str]]):
        self.parser = parser
        self.types = types
        self.state = "name"
        self.name: str | None = None
        self.index: int | None = None
        self.param: str | None = None
        self.value: list[str] = []          # the parameter's text consumed so far (less a leading newline)
        self.lead: bool | None = None       # whether the value opened with the newline the markup puts there
        self.sent = 0                       # characters of a streamed string value already sent
        self.streaming = False
        self.arguments: dict = {}
        self.args_text: list[str] = []

    def _send(self, text: str) -> None:
        self.args_text.append(text)
        self.parser._emit(ToolCallArgumentsDelta(self.index, text))

    def _take(self, piece: str) -> str:
        """A consumed piece of a parameter's value, less the newline that opens it."""
        if self.lead is None and piece:
            self.lead = piece.startswith("\n")
            piece = piece[1:] if self.lead else piece
        if piece:
            self.value.append(piece)
        return piece

    def feed(self, text: str) -> tuple[int, str | None, bool]:
        """(characters consumed, a reason it is malformed, whether `</tool_call>` closed it)."""
        pos = 0
        while True:
            rest = text[pos:]
            if self.state in ("name", "param"):
                end = rest.find(">")
                head = rest if end < 0 else rest[:end]
                what = "function" if self.state == "name" else "parameter"
                if "<" in head or "\n" in head or len(head) > MAX_NAME_CHARS:
                    return pos, f"a {what} name is not closed by '>'", False
                if end < 0:
                    return pos, None, False
                if not head.strip():
                    return pos, f"an empty {what} name", False
                pos += end + 1
                if self.state == "name":
                    self.name, self.state = head.strip(), "between"
                    self.index = self.parser._start_call(self.name)
                else:
                    self.param, self.value, self.lead, self.sent = head.strip(), [], None, 0
                    self.state = "value"
                    self.streaming = self.types.get(self.name, {}).get(self.param) == "string"
                    if self.streaming:
                        self._send(("{" if not self.args_text else ", ") + json.dumps(self.param, ensure_ascii=False)
                                   + ': "')
                continue
            if self.state == "value":
                end = rest.find(PARAMETER_CLOSE)
                if end < 0:
                    keep = _held(rest, "\n" + PARAMETER_CLOSE, PARAMETER_CLOSE)
                    piece = self._take(rest[:len(rest) - keep])
                    pos += len(rest) - keep
                    if self.streaming and piece:
                        self._send(json.dumps(piece, ensure_ascii=False)[1:-1])
                        self.sent += len(piece)
                    return pos, None, False
                self._take(rest[:end])
                pos += end + len(PARAMETER_CLOSE)
                value = "".join(self.value)
                value = value[:-1] if value.endswith("\n") else value
                if self.streaming:
                    self._send(json.dumps(value[self.sent:], ensure_ascii=False)[1:-1] + '"')
                    self.arguments[self.param] = value
                else:
                    typed = _typed(value, self.types.get(self.name, {}).get(self.param))
                    self._send(("{" if not self.args_text else ", ") + json.dumps(self.param, ensure_ascii=False)
                               + ": " + json.dumps(typed, ensure_ascii=False))
                    self.arguments[self.param] = typed
                self.state = "between"
                continue
            stripped = rest.lstrip()
            pos += len(rest) - len(stripped)
            if self.state == "between":
                for tag, state in ((PARAMETER_OPEN, "param"), (FUNCTION_CLOSE, "after")):
                    if stripped.startswith(tag):
                        pos += len(tag)
                        self.state = state
                        break
                else:
                    if not stripped or PARAMETER_OPEN.startswith(stripped) or FUNCTION_CLOSE.startswith(stripped):
                        return pos, None, False
                    return pos, "expected <parameter=…> or </function> in the tool call", False
                if self.state == "after":
                    self._send("}" if self.args_text else "{}")
                continue
            # after </function>: only `</tool_call>` may follow
            if stripped.startswith(CALL_CLOSE):
                pos += len(CALL_CLOSE)
                self.parser._emit(ToolCallEnd(self.index, ToolCall(self.name, self.arguments, "".join(self.args_text))))
                return pos, None, True
            if not stripped or CALL_CLOSE.startswith(stripped):
                return pos, None, False
            return pos, "text after </function> in the tool call", False


# ------------------------------------------------------------------------------------------- parser

_START, _REASONING, _CONTENT, _CALL_OPENED, _CALL, _CALL_RAW = range(6)


class OutputParser:
    """Feed decoded text deltas with `feed`, end with `finish`; both return the new events (a list, maybe
    empty). `tools`: the request's tool schemas, which type the parameters of XML-form calls."""

    def __init__(self, *, thinking: bool = True, starts_in_reasoning: bool = False, parse_tool_calls: bool = True,
                 tools=None):
        self.thinking = thinking
        self.parse_tool_calls = parse_tool_calls
        self._types = _schema_types(tools)
        self._mode = (_REASONING if starts_in_reasoning else _START) if thinking else _CONTENT
        self._lstrip = self._mode == _REASONING       # drop the whitespace that opens a section
        self._buf = ""
        self._raw: list[str] = []                      # the current call's markup so far
        self._call = None
        self._calls = 0
        self._events: list = []
        self._done = False

    @classmethod
    def for_prompt(cls, prompt: str, *, thinking: bool = True, parse_tool_calls: bool = True, tools=None):
        """A parser for the output of `prompt`: in reasoning from the start when the prompt opened `<think>`."""
        return cls(thinking=thinking, starts_in_reasoning=thinking and prompt_opens_thinking(prompt),
                   parse_tool_calls=parse_tool_calls, tools=tools)

    def feed(self, text: str) -> list:
        if self._done:
            raise RuntimeError("OutputParser.feed after finish(): a parser reads one output")
        self._buf += text
        while self._step(False):
            pass
        return self._take()

    def finish(self) -> list:
        """The end of the output: held text is decided (an open call becomes content)."""
        if not self._done:
            while self._step(True):
                pass
            self._done = True
        return self._take()

    # -- internals -----------------------------------------------------------------------------

    def _take(self) -> list:
        events, self._events = self._events, []
        return events

    def _emit(self, event) -> None:
        self._events.append(event)

    def _start_call(self, name: str) -> int:
        index, self._calls = self._calls, self._calls + 1
        self._emit(ToolCallStart(index, name))
        return index

    def _text(self, kind, text: str) -> None:
        if self._lstrip:
            text = text.lstrip()
        if text:
            self._lstrip = False
            self._emit(kind(text))

    def _invalid(self, reason: str) -> None:
        index = getattr(self._call, "index", None)
        raw = "".join(self._raw)
        self._emit(ToolCallInvalid(index, reason, raw))
        self._emit(ContentDelta(raw))
        self._raw, self._call, self._lstrip = [], None, False
        self._mode = _CALL_RAW

    def _step(self, final: bool) -> bool:
        """Handles the buffer in the current mode; True when it changed mode (look again)."""
        buf, mode = self._buf, self._mode
        if mode == _START:
            head = buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._buf, self._mode, self._lstrip = head[len(THINK_OPEN):], _REASONING, True
                return True
            if THINK_OPEN.startswith(head) and not final:
                return False
            self._mode = _CONTENT
            return True
        if mode == _REASONING:
            at = buf.find(THINK_CLOSE)
            if at >= 0:
                self._text(ReasoningDelta, buf[:at].rstrip())
                self._buf, self._mode, self._lstrip = buf[at + len(THINK_CLOSE):], _CONTENT, True
                return True
            self._flush(ReasoningDelta, final, THINK_CLOSE)
            return False
        if mode == _CONTENT:
            at = buf.find(CALL_OPEN) if self.parse_tool_calls else -1
            if at >= 0:
                self._text(ContentDelta, buf[:at].rstrip())
                self._buf, self._raw, self._mode = buf[at + len(CALL_OPEN):], [CALL_OPEN], _CALL_OPENED
                return True
            self._flush(ContentDelta, final, CALL_OPEN if self.parse_tool_calls else None)
            return False
        if mode == _CALL_RAW:
            at = buf.find(CALL_CLOSE)
            if at >= 0:
                self._emit(ContentDelta(buf[:at + len(CALL_CLOSE)]))
                self._buf, self._mode = buf[at + len(CALL_CLOSE):], _CONTENT
                return True
            keep = 0 if final else _held(buf, CALL_CLOSE)
            if len(buf) > keep:
                self._emit(ContentDelta(buf[:len(buf) - keep]))
            self._buf = buf[len(buf) - keep:]
            return False
        if mode == _CALL_OPENED:
            head = buf.lstrip()
            self._raw.append(buf[:len(buf) - len(head)])
            self._buf = head
            if head.startswith("{"):
                self._call, self._mode = _JsonCall(self), _CALL
                return True
            if head.startswith(FUNCTION_OPEN):
                self._raw.append(FUNCTION_OPEN)
                self._buf = head[len(FUNCTION_OPEN):]
                self._call, self._mode = _XmlCall(self, self._types), _CALL
                return True
            if not final and FUNCTION_OPEN.startswith(head):
                return False
            self._invalid("unclosed <tool_call> at the end of the output" if not head
                          else "a tool call is a JSON object or <function=…>")
            return True
        # mode == _CALL
        used, error, closed = self._call.feed(buf)
        self._raw.append(buf[:used])
        self._buf = buf[used:]
        if closed:
            self._raw, self._call, self._mode, self._lstrip = [], None, _CONTENT, True
            return True
        if error or final:
            self._invalid(error or "unclosed <tool_call> at the end of the output")
            return True
        return False

    def _flush(self, kind, final: bool, tag: str | None) -> None:
        """Emits the buffer but for what may still turn out markup: a partial `tag` and the whitespace
        before it (dropped if the tag comes)."""
        buf = self._buf
        if final or tag is None:
            self._text(kind, buf)
            self._buf = ""
            return
        head = buf[:len(buf) - _held(buf, tag)]
        text = head.rstrip()
        self._text(kind, text)
        self._buf = buf[len(text):]


def parse_output(text: str, *, thinking: bool = True, starts_in_reasoning: bool = False,
                 parse_tool_calls: bool = True, tools=None) -> ParsedOutput:
    """The whole output at once: what a non-streamed response returns."""
    parser = OutputParser(thinking=thinking, starts_in_reasoning=starts_in_reasoning,
                          parse_tool_calls=parse_tool_calls, tools=tools)
    return collect(parser.feed(text) + parser.finish())
