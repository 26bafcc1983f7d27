"""events: what `parsing.OutputParser` reports — reasoning and content text, tool calls as they stream
(start, argument deltas, end or invalid) — the markup tags, and the helpers that merge events
(`coalesce`, `collect`) and hold back a tag split across deltas (`held`); `CallSink`, what the tool-call
recognisers (serve.toolcalls) report to."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

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


def held(text: str, *tags: str) -> int:
    """Length of the longest end of `text` that could be the start of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best


class CallSink(Protocol):
    """Where a recogniser reports (`parsing.OutputParser`): a call's start, which gives its index, and its
    argument deltas and end."""

    def start_call(self, name: str) -> int: ...

    def emit(self, event) -> None: ...
