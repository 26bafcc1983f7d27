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

# the events and helpers are part of this module's interface (re-exported from serve.events)
from .events import (CALL_CLOSE, CALL_OPEN, FUNCTION_OPEN, THINK_CLOSE, THINK_OPEN, ContentDelta,  # noqa: F401
                     ParsedOutput, ReasoningDelta, ToolCall, ToolCallArgumentsDelta, ToolCallEnd, ToolCallInvalid,
                     ToolCallStart, coalesce, collect, held, prompt_opens_thinking)
from .toolcalls import JsonCall, XmlCall, schema_types

__all__ = ["ContentDelta", "OutputParser", "ParsedOutput", "ReasoningDelta", "ToolCall", "ToolCallArgumentsDelta",
           "ToolCallEnd", "ToolCallInvalid", "ToolCallStart", "coalesce", "collect", "parse_output",
           "prompt_opens_thinking"]

# parser states
_START, _REASONING, _CONTENT, _CALL_OPENED, _CALL, _CALL_RAW = range(6)




class OutputParser:
    """Feed decoded text deltas with `feed`, end with `finish`; both return the new events (a list, maybe
    empty). `tools`: the request's tool schemas, which type the parameters of XML-form calls."""

    def __init__(self, *, thinking: bool = True, starts_in_reasoning: bool = False, parse_tool_calls: bool = True,
                 tools=None):
        self.thinking = thinking
        self.parse_tool_calls = parse_tool_calls
        self._types = schema_types(tools)
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

    # -- what the tool-call recognisers report to (events.CallSink) --------------------------

    def emit(self, event) -> None:
        self._events.append(event)

    def start_call(self, name: str) -> int:
        index, self._calls = self._calls, self._calls + 1
        self.emit(ToolCallStart(index, name))
        return index

    # -- internals -----------------------------------------------------------------------------

    def _take(self) -> list:
        events, self._events = self._events, []
        return events

    def _text(self, kind, text: str) -> None:
        if self._lstrip:
            text = text.lstrip()
        if text:
            self._lstrip = False
            self.emit(kind(text))

    def _invalid(self, reason: str) -> None:
        index = getattr(self._call, "index", None)
        raw = "".join(self._raw)
        self.emit(ToolCallInvalid(index, reason, raw))
        self.emit(ContentDelta(raw))
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
                self.emit(ContentDelta(buf[:at + len(CALL_CLOSE)]))
                self._buf, self._mode = buf[at + len(CALL_CLOSE):], _CONTENT
                return True
            keep = 0 if final else held(buf, CALL_CLOSE)
            if len(buf) > keep:
                self.emit(ContentDelta(buf[:len(buf) - keep]))
            self._buf = buf[len(buf) - keep:]
            return False
        if mode == _CALL_OPENED:
            head = buf.lstrip()
            self._raw.append(buf[:len(buf) - len(head)])
            self._buf = head
            if head.startswith("{"):
                self._call, self._mode = JsonCall(self), _CALL
                return True
            if head.startswith(FUNCTION_OPEN):
                self._raw.append(FUNCTION_OPEN)
                self._buf = head[len(FUNCTION_OPEN):]
                self._call, self._mode = XmlCall(self, self._types), _CALL
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
        head = buf[:len(buf) - held(buf, tag)]
        text = head.rstrip()
        self._text(kind, text)
        self._buf = buf[len(text):]


def parse_output(text: str, *, thinking: bool = True, starts_in_reasoning: bool = False,
                 parse_tool_calls: bool = True, tools=None) -> ParsedOutput:
    """The whole output at once: what a non-streamed response returns."""
    parser = OutputParser(thinking=thinking, starts_in_reasoning=starts_in_reasoning,
                          parse_tool_calls=parse_tool_calls, tools=tools)
    return collect(parser.feed(text) + parser.finish())
