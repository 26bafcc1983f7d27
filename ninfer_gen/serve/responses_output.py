"""responses_output: the Responses API's output from the output parser's events (serve.parsing) —
`ResponseBuilder` opens and closes the output items as the kind of output changes, `reasoning`
(reasoning_text content), `message` (output_text) and `function_call` (arguments streamed), and gives
each step's stream events (output_item.added, content_part.added, deltas, .done events,
output_item.done) and the chat template's assistant turn. Pure: no HTTP, no engine, no sequence numbers.

A streamed function call is announced as it starts; if its markup then turns out malformed, its item is
closed `incomplete` and left out of the final output (the markup follows as text), as in openai_api."""
from __future__ import annotations

import json

from ninfer_gen.serve.core import new_id
from ninfer_gen.serve.parsing import (ContentDelta, ReasoningDelta, ToolCallArgumentsDelta, ToolCallEnd,
                                      ToolCallInvalid, ToolCallStart)


class ResponseBuilder:
    """Parser events → output items. `events(parser_events)` gives the stream's events (dicts with their
    `type`, without sequence numbers), opening and closing items as the kind of output changes; `close(status)`
    ends the open item; `output()` is the response's items, `message()` the chat template's assistant turn."""

    def __init__(self):
        self.items: list[dict] = []             # every item opened, in stream order (output_index)
        self.open: dict | None = None           # the open item: {"index", "kind", "call"}
        self.calls: dict[int, dict] = {}        # parser call index → its item
        self.arguments: dict[int, dict] = {}    # parser call index → parsed arguments (closed calls)
        self.dropped: set[int] = set()          # output indices of calls whose markup broke

    def _item_event(self, kind: str, index: int, item: dict) -> dict:
        return {"type": f"response.output_item.{kind}", "output_index": index, "item": json.loads(json.dumps(item))}

    def _start(self, item: dict, kind: str, call: int | None = None) -> list[dict]:
        out = self.close()
        index = len(self.items)
        self.items.append(item)
        self.open = {"index": index, "kind": kind, "call": call}
        out.append(self._item_event("added", index, item))
        if kind != "function_call":
            part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else \
                {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            item["content"].append(part)
            out.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": dict(part)})
        return out

    def close(self, status: str = "completed") -> list[dict]:
        if self.open is None:
            return []
        index, kind, self.open = self.open["index"], self.open["kind"], None
        item = self.items[index]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index}
        if kind == "function_call":
            out = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                    "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if kind == "reasoning" else "response.output_text.done"
            out = [{"type": done, **where, "content_index": 0, "text": part["text"],
                    **({"logprobs": []} if kind == "message" else {})},
                   {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)}]
        return out + [self._item_event("done", index, item)]

    def _text(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.open is None or self.open["kind"] != kind:
            item = {"id": new_id("rs_"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"} \
                if kind == "reasoning" else \
                {"id": new_id("msg_"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            out = self._start(item, kind)
        item = self.items[self.open["index"]]
        item["content"][0]["text"] += text
        delta = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        return out + [{"type": delta, "item_id": item["id"], "output_index": self.open["index"], "content_index": 0,
                       "delta": text, **({"logprobs": []} if kind == "message" else {})}]

    def events(self, events) -> list[dict]:
        out = []
        for e in events:
            if isinstance(e, ReasoningDelta):
                out += self._text("reasoning", e.text)
            elif isinstance(e, ContentDelta):
                out += self._text("message", e.text)
            elif isinstance(e, ToolCallStart):
                item = self.calls[e.index] = {"id": new_id("fc_"), "type": "function_call", "call_id": new_id("call_"),
                                              "name": e.name, "arguments": "", "status": "in_progress"}
                out += self._start(item, "function_call", e.index)
            elif isinstance(e, ToolCallArgumentsDelta) and self.open and self.open["call"] == e.index:
                self.calls[e.index]["arguments"] += e.text
                out.append({"type": "response.function_call_arguments.delta", "item_id": self.calls[e.index]["id"],
                            "output_index": self.open["index"], "delta": e.text})
            elif isinstance(e, ToolCallEnd) and self.open and self.open["call"] == e.index:
                self.calls[e.index]["arguments"] = e.call.arguments_json
                self.arguments[e.index] = e.call.arguments
                out += self.close()
            elif isinstance(e, ToolCallInvalid) and e.index is not None and self.open and self.open["call"] == e.index:
                self.dropped.add(self.open["index"])
                out += self.close("incomplete")
        return out

    def output(self) -> list[dict]:
        return [item for i, item in enumerate(self.items) if i not in self.dropped]

    def message(self) -> dict:
        """The output as the chat template's assistant turn (what a later turn's conversation holds)."""
        items = self.output()
        msg = {"role": "assistant", "content": "".join(i["content"][0]["text"] for i in items if i["type"] == "message")}
        reasoning = "".join(i["content"][0]["text"] for i in items if i["type"] == "reasoning")
        if reasoning:
            msg["reasoning_content"] = reasoning
        calls = [(index, item) for index, item in self.calls.items() if index in self.arguments]
        if calls:
            msg["tool_calls"] = [{"id": item["call_id"], "type": "function",
                                  "function": {"name": item["name"], "arguments": self.arguments[index]}}
                                 for index, item in calls]
        return msg
