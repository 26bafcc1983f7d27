"""GPU tier for the server: `ninfer-gen serve --backend gpu` (the cohort engine over lanes.gpu) on
the shipped small model, with the real `openai` SDK — streamed chat equals non-streamed under greedy
decoding with K = 3 drafts, 8 concurrent requests on 4 lanes all finish, a second turn reuses its prefix
(usage and /metrics move), and afterwards no lane or slot is busy.
Run: pytest -m gpu tests/gpu/test_serve_gpu.py -q -s"""
import threading

import pytest

pytestmark = pytest.mark.gpu
openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def served():
    from ninfer_gen.cli.main import build_parser
    from ninfer_gen.cli.serve import build_server
    from tests.test_serve import Server

    args = build_parser().parse_args(["serve", "--backend", "gpu", "--lanes", "4", "--draft", "3",
                                      "--max-context", "2048", "--served-model-name", "small"])
    app, engine, model = build_server(args)
    srv = Server(app, engine)
    yield srv, openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
    srv.close()


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="small", messages=messages, max_tokens=48, temperature=0, **kw)


def test_stream_equals_non_stream_and_concurrent_requests_finish(served):
    from tests.test_serve import USER, _idle

    srv, client = served
    whole = _chat(client, USER)
    streamed = "".join(c.choices[0].delta.content or "" for c in _chat(client, USER, stream=True) if c.choices)
    assert streamed == whole.choices[0].message.content and whole.usage.completion_tokens > 0
    results, errors = [], []

    def one(i):
        try:
            results.append(_chat(client, [{"role": "user", "content": f"Count to {i + 3} in words."}]))
        except Exception as err:                       # noqa: BLE001 — collected and asserted below
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 8
    s = _idle(srv.engine)
    assert s["lanes_busy"] == 0 and s["slots_in_use"] == 0
    print(f"GPU server: {s['requests']} requests, {s['rounds']} rounds, acceptance {s['acceptance']:.3f}")


def test_a_second_turn_reuses_its_prefix(served):
    from tests.test_serve import _idle

    srv, client = served
    turn1 = [{"role": "user", "content": "Write a Python class for a bank account with deposit and withdraw."}]
    first = _chat(client, turn1)
    before = srv.engine.stats()["prefix_hit_tokens"]
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "Now add a transfer method."}]
    second = _chat(client, turn2)
    hit = srv.engine.stats()["prefix_hit_tokens"] - before
    print(f"second turn: {second.usage.prompt_tokens} prompt tokens, {hit} restored from the prefix cache")
    assert hit > 0
    _idle(srv.engine)
