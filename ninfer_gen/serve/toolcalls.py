"""toolcalls: the two Qwen tool-call markups inside `<tool_call>…</tool_call>`, each an incremental
recogniser the output parser feeds character runs: JSON (`JsonCall`, validated character by character,
the arguments streamed as the model's own JSON text) and XML (`XmlCall`, parameters typed by the tools'
schemas, string parameters streamed). A recogniser reports to a `CallSink` (the parser); it never imports
the parser."""
from __future__ import annotations

import json
import re

from .events import (CALL_CLOSE, FUNCTION_CLOSE, MAX_NAME_CHARS, PARAMETER_CLOSE, PARAMETER_OPEN, CallSink,
                     ToolCall, ToolCallArgumentsDelta, ToolCallEnd, held)


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


class JsonCall:
    """One `<tool_call>` body in JSON form: validates it character by character (a JSON automaton),
    watches the members of the top object for "name" and "arguments", and streams the arguments. Keeps
    only what it needs (keys, the name, numbers being read, the arguments' text), so a long call costs
    time in proportion to its length however finely it is fed."""

    def __init__(self, parser: CallSink):
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
            self.index = self.parser.start_call(self.name)
        if self.index is not None and self.args_pending:
            piece = "".join(self.args_pending)
            self.args_pending.clear()
            self.args_text.append(piece)
            self.parser.emit(ToolCallArgumentsDelta(self.index, piece))
        if closed:
            error = self._finish()
        return used, error, closed and error is None

    def _finish(self) -> str | None:
        if self.args_start is None:
            self.parser.emit(ToolCallArgumentsDelta(self.index, "{}"))
            self.args_text.append("{}")
        text = "".join(self.args_text)
        try:
            arguments = json.loads(text)
        except (ValueError, RecursionError):
            return "the tool call's arguments are not valid JSON"
        self.parser.emit(ToolCallEnd(self.index, ToolCall(self.name, arguments, text)))
        return None


# ----------------------------------------------------------------------------------- XML tool calls


def schema_types(tools) -> dict[str, dict[str, str]]:
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


class XmlCall:
    """One `<tool_call>` body in XML form, after `<function=`: the name, the parameters one by one."""

    def __init__(self, parser: CallSink, types: dict[str, dict[str, str]]):
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
        self.parser.emit(ToolCallArgumentsDelta(self.index, text))

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
                    self.index = self.parser.start_call(self.name)
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
                    keep = held(rest, "\n" + PARAMETER_CLOSE, PARAMETER_CLOSE)
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
                self.parser.emit(ToolCallEnd(self.index, ToolCall(self.name, self.arguments, "".join(self.args_text))))
                return pos, None, True
            if not stripped or CALL_CLOSE.startswith(stripped):
                return pos, None, False
            return pos, "text after </function> in the tool call", False
