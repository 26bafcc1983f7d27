"""requests: what a caller of the cohort engine hands in and gets back — `Request` (a token list, sampling
parameters, stop tokens, limits, draft K, an optional grammar, optional images), `Handle` (its events as they come: new
tokens, then a final event with the finish reason and `RequestStats`), `EngineFull` (admission refused).
The engine (engine.engine) makes handles and sends their events; imports no CUDA and no torch."""
from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ninfer_gen.sampling import SamplingParams
from ninfer_gen.vision.preprocess import Processed

if TYPE_CHECKING:
    from ninfer_gen.engine.engine import Engine

FINISH_REASONS = ("stop", "length", "cancelled", "error")


class EngineFull(RuntimeError):
    """submit() refused: every lane is busy (or promised) and `max_queue` requests wait for one."""


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_tokens: int = 64
    sampling: SamplingParams = SamplingParams()
    stop: frozenset[int] = frozenset()
    draft: int = 0                      # MTP drafts per round (0: plain steps)
    id: str | None = None
    max_context: int | None = None      # this request's context limit (≤ the backend's)
    constraint: Any = None              # structured output: an engine.grammar.Grammar (None: free text)
    images: Processed | None = None     # the prompt's images (preprocessed) in order of their placeholders, which
                                        # the prompt holds expanded: one image token per merged patch

    def __post_init__(self):
        object.__setattr__(self, "prompt", tuple(int(t) for t in self.prompt))
        object.__setattr__(self, "stop", frozenset(int(t) for t in self.stop))
        if not self.prompt:
            raise ValueError("the prompt is empty")
        if not isinstance(self.sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.constraint is not None and not callable(getattr(self.constraint, "matcher", None)):
            raise ValueError(f"constraint must be a compiled grammar (engine.grammar.Grammar), "
                             f"got {type(self.constraint).__name__}")
        if self.images is not None and not isinstance(self.images, Processed):
            raise ValueError(f"images must be preprocessed (ninfer_gen.vision.preprocess.Processed), "
                             f"got {type(self.images).__name__}")
        if self.images is not None and not self.images.grids:
            object.__setattr__(self, "images", None)
        for name in ("max_tokens", "draft", "max_context"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < (0 if name == "draft" else 1)):
                raise ValueError(f"{name} must be an integer ≥ {0 if name == 'draft' else 1}, got {value!r}")


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    tokens: int                         # output tokens
    queued_s: float                     # submit → a lane
    ttft_s: float | None                # submit → first token (None: none came)
    decode_s: float                     # first token → last token
    rounds: int
    drafted: int
    accepted: int
    cached_tokens: int = 0              # prompt tokens restored from a prefix checkpoint, not prefilled

    @property
    def decode_tok_s(self) -> float:
        return (self.tokens - 1) / self.decode_s if self.tokens > 1 and self.decode_s > 0 else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Output tokens per decode round (the prefill's first token apart)."""
        return (self.tokens - 1) / self.rounds if self.rounds else 0.0


@dataclass(frozen=True)
class Event:
    """New tokens of a request; the last event has `finish` (one of FINISH_REASONS) and `stats`."""
    id: str
    tokens: tuple[int, ...] = ()
    finish: str | None = None
    stats: RequestStats | None = None
    error: str | None = None


class Handle:
    """A submitted request: iterate it for its events (the final one last); `tokens` and `final` are what the
    engine has sent so far. Without a background loop, iterating drives `engine.step()` itself."""

    def __init__(self, engine: "Engine", request_id: str):
        self.id, self._engine = request_id, engine
        self._events: queue.Queue[Event] = queue.Queue()
        self.tokens: list[int] = []             # every token sent so far
        self.final: Event | None = None         # the final event, once sent
        self._done = False                      # the reader has had the final event

    def __iter__(self):
        while not self._done:
            event = self._next()
            self._done = event.finish is not None
            yield event

    def result(self) -> Event:
        """Reads every event; the final one (all tokens are in `tokens`)."""
        for _ in self:
            pass
        return self.final

    def poll(self) -> list[Event]:
        """The events that have arrived, without waiting or driving the engine."""
        events = []
        while not self._done and not self._events.empty():
            events.append(self._events.get_nowait())
            self._done = events[-1].finish is not None
        return events

    def cancel(self) -> bool:
        return self._engine.cancel(self.id)

    def send(self, event: Event) -> None:
        """The engine's side: queue an event for the reader (thread-safe)."""
        self._events.put(event)

    def _next(self) -> Event:
        while True:
            try:
                return self._events.get_nowait()
            except queue.Empty:
                pass
            if self._engine.running:
                try:
                    return self._events.get(timeout=0.05)
                except queue.Empty:
                    continue
            if not self._engine.step() and self._events.empty():
                raise RuntimeError(f"request {self.id}: the engine is idle and sent no final event")
