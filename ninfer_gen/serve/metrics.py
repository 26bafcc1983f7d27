"""metrics: the server's Prometheus metrics — counters, histograms and the engine's gauges, rendered in
the text exposition format (version 0.0.4) for `GET /metrics`. Written here, with no client library:
`Metrics` holds what the HTTP layer and `core.Generation` observe (requests by endpoint and finish reason,
HTTP responses by status, prompt and generated tokens, time to first token, inter-token latency, request
duration); `Metrics.render(engine.stats())` adds the engine's state (queue, lanes, KV pages, state slots,
speculative acceptance). Observations come from the server's event loop; a lock keeps a scrape consistent.

Latencies are measured where the server receives tokens from the engine (it polls every few ms), so they
are what a client sees minus the network, not the engine's own step times."""
from __future__ import annotations

import math
import threading

# seconds: from sub-millisecond inter-token gaps to a request that runs to the default timeout
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/messages",
             "/v1/messages/count_tokens", "/v1/responses")
PREFIX = "ninfer_"
# engine.stats() keys → (metric name, help)
ENGINE_COUNTERS = (("requests", "engine_requests_total", "Requests the engine accepted."),
                   ("prefill_tokens", "engine_prefill_tokens_total", "Prompt tokens prefilled."),
                   ("tokens", "engine_tokens_total", "Tokens the engine emitted."),
                   ("rounds", "engine_rounds_total", "Decode rounds run."),
                   ("lane_rounds", "engine_lane_rounds_total", "Lanes' decode rounds (a round of B lanes counts B)."),
                   ("drafted", "engine_draft_tokens_total", "MTP draft tokens proposed."),
                   ("accepted", "engine_accepted_draft_tokens_total", "MTP draft tokens accepted."))
ENGINE_GAUGES = (("queue_depth", "queue_depth", "Requests waiting for a lane."),
                 ("max_queue", "queue_capacity", "Requests that may wait (beyond them: 429)."),
                 ("lanes_busy", "lanes_busy", "Lanes running a request."),
                 ("lanes", "lanes", "Lanes (requests decoded at once)."),
                 ("pages_in_use", "kv_pages_in_use", "KV cache pages held (by sequences or cached prefixes)."),
                 ("pages", "kv_pages", "KV cache pages in the pool."),
                 ("slots_in_use", "state_slots_in_use", "Recurrent (GDN) state slots held."),
                 ("slots", "state_slots", "Recurrent (GDN) state slots in the pool."),
                 ("acceptance", "spec_acceptance_ratio", "Accepted / proposed MTP draft tokens since start "
                  "(0 without drafts)."))


def endpoint_label(path: str) -> str:
    """A request path as a label value of bounded cardinality: a known endpoint, a stored response's path
    pattern, or "other" (unknown paths must not make new series)."""
    if path in ENDPOINTS:
        return path
    if path.startswith("/v1/responses/") and "/" not in path[len("/v1/responses/"):]:
        return "/v1/responses/{id}"
    return "other"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _labels(names: tuple[str, ...], values: tuple, extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if value == math.inf:
        return "+Inf"
    return repr(int(value)) if float(value).is_integer() else repr(float(value))


class Counter:
    """A monotonically increasing value per label set."""
    kind = "counter"

    def __init__(self, name: str, help: str, labels: tuple[str, ...] = ()):
        self.name, self.help, self.labels = PREFIX + name, help, labels
        self.values: dict[tuple, float] = {} if labels else {(): 0}    # an unlabelled counter starts at 0

    def inc(self, *values, amount: float = 1) -> None:
        self.values[values] = self.values.get(values, 0) + amount

    def get(self, *values) -> float:
        return self.values.get(values, 0)

    def samples(self) -> list[str]:
        return [f"{self.name}{_labels(self.labels, k)} {_number(v)}" for k, v in sorted(self.values.items())]


class Histogram:
    """Observations counted into cumulative `le` buckets, with their sum and count (no labels)."""
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets=LATENCY_BUCKETS):
        self.name, self.help, self.buckets = PREFIX + name, help, tuple(buckets) + (math.inf,)
        self.counts = [0] * len(self.buckets)        # per bucket, not cumulative
        self.sum, self.count = 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        value = max(0.0, value)
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += times
                break
        self.sum += value * times
        self.count += times

    def samples(self) -> list[str]:
        out, running = [], 0
        for bound, n in zip(self.buckets, self.counts):
            running += n
            out.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {running}')
        return out + [f"{self.name}_sum {_number(self.sum)}", f"{self.name}_count {self.count}"]


def _family(metric) -> list[str]:
    return [f"# HELP {metric.name} {metric.help}", f"# TYPE {metric.name} {metric.kind}", *metric.samples()]


def _gauge(name: str, help: str, value) -> list[str]:
    return [f"# HELP {PREFIX}{name} {help}", f"# TYPE {PREFIX}{name} gauge", f"{PREFIX}{name} {_number(value)}"]


class Metrics:
    """What the server observes. `finish_reason` of a request: stop, length, stop_sequence, timeout,
    cancelled (the client went away) or error."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = Counter("requests_total", "Generation requests by endpoint and how they ended.",
                                ("endpoint", "finish_reason"))
        self.responses = Counter("http_responses_total", "HTTP responses by endpoint and status code (429: the "
                                 "engine's queue was full).", ("endpoint", "status"))
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens of the requests the engine took.")
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated (received from the engine).")
        self.ttft = Histogram("time_to_first_token_seconds", "Request arrival (submission) to its first token.")
        self.itl = Histogram("inter_token_latency_seconds", "Gap between a request's successive tokens (a gap "
                             "shared by the tokens that came together).")
        self.duration = Histogram("request_duration_seconds", "Submission to the end of a generation request.")

    def response(self, endpoint: str, status: int) -> None:
        with self.lock:
            self.responses.inc(endpoint, str(status))

    def submitted(self, prompt_tokens: int) -> None:
        with self.lock:
            self.prompt_tokens.inc(amount=prompt_tokens)

    def tokens(self, n: int, *, ttft: float | None = None, gap: float | None = None) -> None:
        """`n` tokens received at once: the first of a request (`ttft`: since its submission) and/or later
        ones (`gap`: since the request's previous tokens, shared by the later ones)."""
        with self.lock:
            self.generation_tokens.inc(amount=n)
            if ttft is not None:
                self.ttft.observe(ttft)
                n -= 1
            if gap is not None and n > 0:
                self.itl.observe(gap / n, times=n)

    def finished(self, endpoint: str, reason: str, duration: float) -> None:
        with self.lock:
            self.requests.inc(endpoint, reason)
            self.duration.observe(duration)

    def render(self, stats: dict) -> str:
        """The exposition text: the observed metrics, then the engine's counters and gauges from `stats`
        (engine.Engine.stats()); a numeric stat not named here (a backend's own, e.g. a prefix cache's)
        becomes a gauge `ninfer_engine_<key>`."""
        finished = Counter("engine_finished_total", "Requests the engine finished, by reason.", ("reason",))
        for reason, n in sorted(stats.get("finished", {}).items()):
            finished.inc(reason, amount=n)
        counters = [finished]
        for key, name, help in ENGINE_COUNTERS:
            counters.append(Counter(name, help))
            counters[-1].inc(amount=stats.get(key, 0))
        lines = []
        with self.lock:
            for metric in (self.requests, self.responses, self.prompt_tokens, self.generation_tokens, self.ttft,
                           self.itl, self.duration, *counters):
                lines += _family(metric)
        for key, name, help in ENGINE_GAUGES:
            if key in stats:
                lines += _gauge(name, help, stats[key])
        named = {"finished"} | {key for key, _, _ in ENGINE_COUNTERS + ENGINE_GAUGES}
        for key, value in sorted(stats.items()):
            if key not in named and isinstance(value, (int, float)) and not isinstance(value, bool):
                lines += _gauge(f"engine_{key}", f"engine.stats()['{key}'].", value)
        return "\n".join(lines) + "\n"
