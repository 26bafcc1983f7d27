"""The server under faults and load (ninfer_gen.serve: app, core, metrics): a real uvicorn server (test_serve's
Server) over the shipped small model on the reference backend, 4 lanes and a small queue.
- /metrics parses as Prometheus text and its counters and histograms move with the requests;
- 1,000 malformed requests across every endpoint (wrong JSON types in fields, missing fields, garbage bytes,
  huge numbers, wrong content types, non-object bodies, unknown paths and methods) get no 5xx, every answer
  in its API's error shape, and leave no lane, slot or page held;
- 64 concurrent streaming clients over the four streaming APIs: no error but 429 (retried after a pause),
  every lane, slot and page free after; client-side TTFT and inter-token latency percentiles printed
  (`pytest -s`: figures for the notes, not asserted);
- the request timeout (a tiny one): 504 in each API's shape, a streamed error event, the lane freed."""
from __future__ import annotations

import asyncio
import json
import random
import re
import time

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

import ninfer_gen  # noqa: E402
from ninfer_gen.engine import Engine  # noqa: E402
from ninfer_gen.lanes.reference import ReferenceLanes  # noqa: E402
from ninfer_gen.api import DEFAULT_MODEL  # noqa: E402
from ninfer_gen.serve.app import create_app  # noqa: E402
from test_serve import KEY, NAME, USER, Server, _idle  # noqa: E402

HEADERS = {"Authorization": f"Bearer {KEY}"}
LANES, MAX_QUEUE = 4, 4
BODIES = {                              # a valid request per endpoint, with a short budget
    "/v1/chat/completions": {"model": NAME, "messages": USER, "max_tokens": 2},
    "/v1/completions": {"model": NAME, "prompt": "def f(", "max_tokens": 2},
    "/v1/messages": {"model": NAME, "max_tokens": 2, "messages": USER},
    "/v1/messages/count_tokens": {"model": NAME, "messages": USER},
    "/v1/responses": {"model": NAME, "input": "hi", "max_output_tokens": 2},
}
BUDGETS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_SAMPLING = ("temperature", "top_p", "seed", "stream")
FIELDS = {                              # the fields each endpoint reads (others are ignored, as unknown fields are)
    "/v1/chat/completions": ("model", "messages", *_SAMPLING, "top_k", "stop", "stream_options", "tools",
                             "tool_choice", "n", "logprobs", "response_format", "chat_template_kwargs",
                             "max_completion_tokens", "logit_bias"),
    "/v1/completions": ("model", "prompt", *_SAMPLING, "stop", "n", "logprobs", "echo", "suffix", "best_of"),
    "/v1/messages": ("model", "messages", "system", *_SAMPLING[:2], "top_k", "stop_sequences", "stream", "tools",
                     "tool_choice", "thinking"),
    "/v1/messages/count_tokens": ("model", "messages", "system", "tools", "tool_choice", "thinking"),
    "/v1/responses": ("model", "input", "instructions", *_SAMPLING, "tools", "tool_choice", "store",
                      "previous_response_id", "reasoning", "text", "metadata", "parallel_tool_calls", "background",
                      "truncation"),
}


@pytest.fixture(scope="module")
def server():
    model = ninfer_gen.load(DEFAULT_MODEL)
    engine = Engine(ReferenceLanes.for_model(model, LANES), lanes=LANES, max_queue=MAX_QUEUE)
    srv = Server(create_app(engine, model, served_model_name=NAME, api_key=KEY, model_folder=DEFAULT_MODEL), engine)
    yield srv
    srv.close()


def _free(engine) -> dict:
    """The engine's stats once idle, checked: no lane, slot or page held by a request (pages a prefix cache
    keeps for reuse are not a request's), no request failed."""
    stats = _idle(engine)
    assert stats["lanes_busy"] == stats["queue_depth"] == stats["slots_in_use"] == 0
    assert stats["pages_in_use"] == stats.get("pages_cached", 0), stats
    assert "error" not in stats["finished"], stats
    return stats


# ----------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? '
                     r'(-?[0-9.eE+-]+|\+Inf|NaN)$')


def _metrics(url: str) -> dict[str, float]:
    """/metrics parsed (the text format's grammar checked line by line): {'name{labels}': value}."""
    r = httpx.get(url + "/metrics")                           # no key: /metrics is not under /v1
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples, typed = {}, set()
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram") and name not in typed
            typed.add(name)
        elif not line.startswith("# HELP "):
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            assert re.sub(r"_(bucket|sum|count)$", "", m[1]) in typed
            samples[m[1] + (m[2] or "")] = float(m[3])
    return samples


def test_metrics_parse_and_move(server):
    before = _metrics(server.url)
    for name in ("ninfer_lanes", "ninfer_lanes_busy", "ninfer_queue_depth", "ninfer_kv_pages", "ninfer_kv_pages_in_use",
                 "ninfer_state_slots_in_use", "ninfer_spec_acceptance_ratio", "ninfer_prompt_tokens_total"):
        assert name in before
    assert before["ninfer_lanes"] == LANES
    r = httpx.post(server.url + "/v1/completions", headers=HEADERS, json={**BODIES["/v1/completions"],
                                                                          "max_tokens": 5})
    assert r.status_code == 200
    _free(server.engine)
    after = _metrics(server.url)
    key = 'ninfer_requests_total{endpoint="/v1/completions",finish_reason="length"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["ninfer_generation_tokens_total"] == before["ninfer_generation_tokens_total"] + 5
    assert after["ninfer_prompt_tokens_total"] > before["ninfer_prompt_tokens_total"]
    ok = 'ninfer_http_responses_total{endpoint="/v1/completions",status="200"}'
    assert after[ok] == before.get(ok, 0) + 1
    ttft, itl = "ninfer_time_to_first_token_seconds", "ninfer_inter_token_latency_seconds"
    assert after[ttft + "_count"] == before[ttft + "_count"] + 1 and after[itl + "_count"] == before[itl + "_count"] + 4
    buckets = [v for k, v in after.items() if k.startswith(itl + "_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == after[itl + "_count"]        # cumulative, +Inf = count


# ----------------------------------------------------------------- malformed requests


def _junk(rng: random.Random, depth: int = 0):
    """A random JSON value: every type but null (which means absent), huge and odd numbers, nesting."""
    makers = [lambda: True, lambda: rng.randint(-3, 3), lambda: 10 ** rng.choice((19, 30, 400)),
              lambda: -10 ** 19, lambda: rng.choice((1e308, -0.5, 2.5)), lambda: "x" * rng.choice((0, 1, 300)),
              lambda: [_junk(rng, depth + 1) for _ in range(rng.randrange(3))],
              lambda: {rng.choice(("type", "role", "text", "content", "name")): _junk(rng, depth + 1)},
              lambda: [{"role": rng.choice(("user", "assistant", "tool", "bot")), "content": _junk(rng, depth + 1)}]]
    return makers[rng.randrange(len(makers) if depth < 2 else 6)]()


def _bad_budget(rng: random.Random):
    """A max-tokens value that is never valid (never null: an unset budget is the whole context)."""
    return rng.choice((0, -1, 10 ** 9, 10 ** 400, 2.5, "8", [], {}, True))


def _malformed(rng: random.Random) -> tuple[str, str, bytes, dict]:
    """(method, path, body, headers) of a request with at least one defect, or one whose defects may all be
    harmless (a random value that happens to be valid) but whose budget stays tiny."""
    path = rng.choice(list(BODIES))
    body = json.loads(json.dumps(BODIES[path]))
    headers = dict(HEADERS, **{"content-type": "application/json"})
    kind = rng.randrange(10)
    if kind == 0:                                             # garbage bytes
        return "POST", path, rng.randbytes(rng.randrange(1, 64)), headers
    if kind == 1:                                             # JSON, not an object
        return "POST", path, json.dumps(_junk(rng, 2)).encode(), headers
    if kind == 2:                                             # a required field missing
        body.pop(rng.choice([k for k in body if k not in BUDGETS] or ["model"]), None)
    elif kind == 3 and path != "/v1/messages/count_tokens":  # a budget no server may run
        body[next(k for k in body if k in BUDGETS)] = _bad_budget(rng)
    elif kind == 4:                                           # a wrong content type (and a broken body)
        headers["content-type"] = rng.choice(("text/plain", "application/x-www-form-urlencoded", "image/png"))
        return "POST", path, rng.choice((b"a=1&b=2", b"", rng.randbytes(16))), headers
    elif kind == 5:                                           # an unknown path or a wrong method
        return rng.choice((("GET", path), ("POST", "/v1/nothing"), ("PUT", "/v1/responses"),
                           ("GET", "/v1/responses/resp_missing"), ("DELETE", "/v1/responses/x"))) + (b"", headers)
    else:                                                     # random values in one to three fields
        for _ in range(rng.randint(1, 3)):
            field = rng.choice(FIELDS[path])
            body[field] = _bad_budget(rng) if field in BUDGETS else _junk(rng)
    return "POST", path, json.dumps(body).encode(), headers


def _check_error_shape(path: str, status: int, body: dict) -> None:
    if path.startswith("/v1/messages"):
        assert set(body) == {"type", "error"} and body["type"] == "error"
        assert set(body["error"]) == {"type", "message"} and isinstance(body["error"]["message"], str)
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert status in (400, 404, 405, 429), status


def test_fuzz_malformed_requests(server):
    rng = random.Random(22)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(1000):
            method, path, content, headers = _malformed(rng)
            r = client.request(method, path, content=content, headers=headers)
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (method, path, content[:300], r.text)
            if r.status_code >= 400:
                _check_error_shape(path, r.status_code, r.json())
            elif r.headers["content-type"].startswith("text/event-stream"):
                assert "error" not in r.text.split("data:")[-1], r.text
    print(f"\n[fuzz: HTTP statuses of 1,000 malformed requests: {dict(sorted(statuses.items()))}]")
    assert sum(n for s, n in statuses.items() if s >= 400) >= 900      # harmless mutations are rare
    _free(server.engine)


def test_fields_that_only_look_like_defaults_and_prompt_naming(server):
    """best_of=true is not the default 1 (True == 1 in Python); an over-long completions prompt names `prompt`."""
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        r = client.post("/v1/completions", json={**BODIES["/v1/completions"], "best_of": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
        r = client.post("/v1/completions", json={**BODIES["/v1/completions"], "prompt": "x " * (server.engine.backend.max_context + 8)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


# ----------------------------------------------------------------- load


def _stream_request(i: int) -> tuple[str, dict]:
    path = list(BODIES)[[0, 1, 2, 4][i % 4]]
    body = {**BODIES[path], "stream": True, "temperature": 0}
    return path, {**body, **{k: 4 for k in BUDGETS if k in body}}


def _text_of(path: str, event: dict) -> str:
    if path == "/v1/chat/completions":
        return "".join(c["delta"].get("content") or "" for c in event.get("choices", []))
    if path == "/v1/completions":
        return "".join(c["text"] for c in event.get("choices", []))
    if path == "/v1/messages":
        return event.get("delta", {}).get("text", "") if event.get("type") == "content_block_delta" else ""
    return event.get("delta", "") if event.get("type") == "response.output_text.delta" else ""


async def _client(http, i: int, rejected: list, ttft: list, itl: list) -> None:
    path, body = _stream_request(i)
    while True:
        t0 = time.perf_counter()
        async with http.stream("POST", path, json=body, headers=HEADERS) as r:
            if r.status_code == 429:
                rejected.append(i)
                await r.aread()
                await asyncio.sleep(float(r.headers["Retry-After"]) * random.uniform(0.2, 1.0))
                continue
            assert r.status_code == 200, (path, r.status_code, await r.aread())
            stamps, last = [], None
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert "error" not in event and event.get("type") != "error", event
                    if _text_of(path, event):
                        stamps.append(time.perf_counter())
                    last = event
            assert last is not None and stamps, (path, last)
            ttft.append(stamps[0] - t0)
            itl.extend(b - a for a, b in zip(stamps, stamps[1:]))
            return


def _percentiles(xs: list[float]) -> str:
    xs = sorted(xs)
    return " ".join(f"p{q}={1000 * xs[min(len(xs) - 1, int(q / 100 * len(xs)))]:.0f}ms" for q in (50, 99))


def test_load_64_streaming_clients(server):
    rejected, ttft, itl = [], [], []

    async def main():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*(_client(http, i, rejected, ttft, itl) for i in range(64)))

    t0 = time.perf_counter()
    asyncio.run(main())
    wall = time.perf_counter() - t0
    print(f"\n[load: 64 streaming clients, {LANES} lanes, max_queue {MAX_QUEUE}: {len(rejected)} answers 429 "
          f"(retried), {wall:.1f} s; TTFT {_percentiles(ttft)} (queueing included); inter-token {_percentiles(itl)} "
          f"over {len(itl)} gaps]")
    assert len(ttft) == 64 and rejected                      # every client served in the end, some refused first
    stats = _free(server.engine)
    assert stats["finished"].get("cancelled", 0) == 0


# ----------------------------------------------------------------- request timeout


def test_request_timeout_cancels_and_answers_504():
    model = ninfer_gen.load(DEFAULT_MODEL)
    engine = Engine(ReferenceLanes.for_model(model, 1), lanes=1, max_queue=1)
    srv = Server(create_app(engine, model, served_model_name=NAME, model_folder=DEFAULT_MODEL, request_timeout=0.3),
                 engine)
    long = {"max_tokens": 400, "temperature": 0}
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            t0 = time.monotonic()
            r = client.post("/v1/chat/completions", json={"model": NAME, "messages": USER, **long})
            assert r.status_code == 504 and time.monotonic() - t0 < 5 and r.headers["x-should-retry"] == "false"
            assert r.json()["error"]["code"] == "timeout" and "timeout" in r.json()["error"]["message"]
            r = client.post("/v1/messages", json={"model": NAME, "messages": USER, **long})
            assert r.status_code == 504 and r.json()["type"] == "error"
            with client.stream("POST", "/v1/completions", json={"model": NAME, "prompt": "def f(", "stream": True,
                                                                 **long}) as s:
                lines = [line for line in s.iter_lines() if line.startswith("data: ")]
            assert lines[-1] == "data: [DONE]" and "timeout" in json.loads(lines[-2][6:])["error"]["message"]
            with client.stream("POST", "/v1/responses", json={"model": NAME, "input": "hi", "stream": True,
                                                               "max_output_tokens": 400}) as s:
                events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
            assert [e["type"] for e in events[-2:]] == ["error", "response.failed"] and events[-2]["code"] == "timeout"
            with pytest.raises(openai.APIStatusError) as err:       # the SDK does not retry it
                openai.OpenAI(base_url=srv.url + "/v1", api_key="k", max_retries=2).completions.create(
                    model=NAME, prompt="def f(", max_tokens=400, temperature=0)   # (sampled, it may stop early)
            assert err.value.status_code == 504
        stats = _free(engine)
        assert stats["finished"]["cancelled"] == 5          # five requests, each cancelled once: no retry
        assert _metrics(srv.url)['ninfer_requests_total{endpoint="/v1/chat/completions",finish_reason="timeout"}'] == 1
    finally:
        srv.close()


def test_cli_request_timeout_flag():
    from ninfer_gen.cli.main import build_parser
    from ninfer_gen.cli.serve import DEFAULT_TIMEOUT_S, build_server
    from ninfer_gen.serve import core

    assert DEFAULT_TIMEOUT_S == core.DEFAULT_TIMEOUT_S            # the CLI keeps its own copy (no torch at parse time)
    for flag, expected in (([], core.DEFAULT_TIMEOUT_S), (["--request-timeout", "2.5"], 2.5),
                           (["--request-timeout", "0"], None)):
        app, _, _ = build_server(build_parser().parse_args(["serve", "--lanes", "1", *flag]))
        assert app.state.serve.request_timeout == expected
    with pytest.raises(ValueError, match="--request-timeout"):
        build_server(build_parser().parse_args(["serve", "--request-timeout", "-1"]))


def test_usage_reports_prompt_tokens_restored_from_the_prefix_cache(server):
    """A prompt extending an earlier one restores its checkpoint: usage says how many prompt tokens were
    cached (prompt_tokens_details.cached_tokens)."""
    first = list(range(300, 360))
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as client:
        body = {"model": NAME, "max_tokens": 2, "temperature": 0}
        a = client.post("/v1/completions", json={**body, "prompt": first}).json()
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        b = client.post("/v1/completions", json={**body, "prompt": first + [400, 401, 402]}).json()
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == len(first)
    _free(server.engine)
