"""The OpenAI-compatible HTTP API (strata-daemon --http-listen) through the `openai` Python package.

One daemon for the module, on a free loopback port, with the default model (SmolLM2-135M-Instruct Q4_1). Checked:
chat with and without streaming (the deltas concatenate to the non-streamed text; one usage chunk with no choices),
completions, models, stop strings, a cancelled stream (the next request starts at once), bad requests (4xx with
OpenAI's error object, the daemon still serving), and /metrics parsed by prometheus_client.

Tools: SmolLM2's own template has none (tools are refused with param `tools`); a second daemon runs the same model
under a Qwen2.5-style template that offers tools (tests/data/chat/hermes-tools.jinja, written into a copy of the
GGUF by gguf_template.py): the tools reach the prompt (prompt_tokens grows; `tool_choice: none` leaves it as without
tools), a history with calls and results renders, bad shapes and an unknown `tool_choice` function are 400s naming
the field, tools or call arguments that the template would print as over 4 MiB of prompt are 400s (in a body under
the 4 MiB body limit), and a named `tool_choice` (the reply opens with the call) comes back as the same tool call or content,
streamed or not.

Setup and run: as tests/python/test_grpc_client.py (requirements.txt holds openai and prometheus_client).
"""

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

MODEL_ID = "SmolLM2-135M-Instruct.Q4_1"


from strata_paths import REPO, bin_dir as _bin_dir, model_path as _model_path  # noqa: E402
from gguf_template import with_chat_template  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*extra, model=None):
    """A daemon with the HTTP API on a free loopback port (and `extra` flags; `model` for another GGUF than the
    default); returns (process, base URL, log)."""
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="strata-http-")
    log = open(os.path.join(tmp, "daemon.log"), "w")
    proc = subprocess.Popen(
        [str(_bin_dir() / "strata-daemon"), "--model", str(model or _model_path()), "--socket", os.path.join(tmp, "s.sock"),
         "--threads", "2", "--ctx", "1024", "--http-listen", f"127.0.0.1:{port}", *extra],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return proc, url, log.name
        except (urllib.error.URLError, ConnectionError):
            assert proc.poll() is None, open(log.name).read()
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("the daemon did not start: " + open(log.name).read())


def _serve(model=None):
    """A fixture's daemon (`model`: as in _start): yields its base URL, then stops it and checks it exited cleanly."""
    proc, url, log = _start(model=model)
    yield url
    proc.terminate()
    assert proc.wait(timeout=30) == 0, open(log).read()


def _client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def base_url():
    yield from _serve()


@pytest.fixture(scope="module")
def client(base_url):
    return _client(base_url)


CHAT = [{"role": "user", "content": "Name three colours."}]


def test_models(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL_ID]


def test_chat_stream_equals_non_stream(client):
    whole = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=24, temperature=0)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 24 and whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    deltas = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert deltas == text
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].choices == [] and usage[0].usage.completion_tokens == 24
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completions_and_stop(client):
    r = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=16, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens > 0
    first = r.choices[0].text.split()[0]
    s = client.completions.create(model=MODEL_ID, prompt="The capital of France is", max_tokens=16,
                                  temperature=0, stop=[first])
    assert first not in s.choices[0].text and s.choices[0].finish_reason == "stop"


def test_sampler_fields_and_seeds(client):
    """llama.cpp's `top_k` reaches the sampler (top-k 1 at temperature 1.5 is the greedy text); a seed repeats its
    draw; without a seed two sampled requests draw apart (16 tokens at temperature 1.5 each time, 5 tries: all equal
    only if every draw repeats)."""
    prompt = "Once upon a time"
    greedy = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=0)
    top1 = client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=1.5,
                                     extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text
    seeded = [client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=1.5, seed=7)
              .choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    free = {client.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=16, temperature=1.5)
            .choices[0].text for _ in range(5)}
    assert len(free) > 1, free


def test_a_cancelled_stream_frees_the_engine(client):
    stream = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=900, temperature=0.7,
                                            stream=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    t0 = time.time()
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
    assert time.time() - t0 < 20, "the cancelled request kept the engine busy"


def _post(base_url, body: bytes):
    req = urllib.request.Request(base_url + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_bad_requests_are_openai_errors(client, base_url):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=4, temperature=7)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_ID, messages=[], max_tokens=4)
    status, body = _post(base_url, b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    status, body = _post(base_url, b'{"model": "x", "pad": "' + b"a" * (5 << 20) + b'"}')
    assert status == 413 and "error" in body
    # still serving
    r = client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def _metrics(base_url):
    text = urllib.request.urlopen(base_url + "/metrics", timeout=10).read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = s.value
    return out


def test_metrics_parse_and_move(client, base_url):
    before = _metrics(base_url)
    assert "strata_blob_reads_per_token" in before and "vllm:generation_tokens_total" in before
    client.chat.completions.create(model=MODEL_ID, messages=CHAT, max_tokens=3, temperature=0)
    after = _metrics(base_url)
    assert after["vllm:generation_tokens_total"] == before["vllm:generation_tokens_total"] + 3
    assert after["strata_requests_total"] == before["strata_requests_total"] + 1


def test_the_api_key_guards_v1():
    proc, url, _ = _start("--api-key", "s3cret")
    try:
        def status(auth):
            req = urllib.request.Request(url + "/v1/models", headers={"Authorization": auth} if auth else {})
            try:
                return urllib.request.urlopen(req, timeout=10).status
            except urllib.error.HTTPError as e:
                return e.code

        assert status(None) == 401 and status("Bearer wrong") == 401 and status("Bearer s3cret") == 200
        assert status("bearer s3cret") == 200, "the scheme is case-insensitive"
        ok = openai.OpenAI(base_url=url + "/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in ok.models.list().data] == [MODEL_ID]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _error(base_url, body: dict):
    status, reply = _post(base_url, json.dumps(body).encode())
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", (status, reply)
    return reply["error"]


def test_tools_need_a_template_that_offers_them(client, base_url):
    err = _error(base_url, {"model": MODEL_ID, "messages": ASK, "tools": WEATHER, "max_tokens": 2})
    assert err["param"] == "tools" and "does not support tools" in err["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=WEATHER, max_tokens=2)
    # tool_choice none: the tools are not offered, so nothing is dropped silently
    r = client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=WEATHER, tool_choice="none",
                                       max_tokens=2, temperature=0)
    assert r.choices[0].message.tool_calls is None


@pytest.fixture(scope="module")
def tools_url(tmp_path_factory):
    gguf = tmp_path_factory.mktemp("tools") / (MODEL_ID + ".gguf")
    template = (REPO / "tests" / "data" / "chat" / "hermes-tools.jinja").read_text()
    with_chat_template(_model_path(), gguf, template)
    yield from _serve(model=gguf)


@pytest.fixture(scope="module")
def tools_client(tools_url):
    return _client(tools_url)


def test_tools_reach_the_prompt(tools_client):
    def prompt_tokens(**kw):
        r = tools_client.chat.completions.create(model=MODEL_ID, max_tokens=1, temperature=0, **kw)
        return r.usage.prompt_tokens

    plain = prompt_tokens(messages=ASK)
    offered = prompt_tokens(messages=ASK, tools=WEATHER)
    assert offered > plain + 40, (plain, offered)
    assert prompt_tokens(messages=ASK, tools=WEATHER, tool_choice="none") == plain
    # a conversation with the assistant's call and the tool's result renders (both add to the prompt)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                "function": {"name": "get_weather",
                                                                             "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_c": 21}'},
    ]
    assert prompt_tokens(messages=history, tools=WEATHER) > offered + 20


def test_bad_tool_requests_are_400s_naming_the_field(tools_client, tools_url):
    base = {"model": MODEL_ID, "messages": ASK, "max_tokens": 2}
    assert _error(tools_url, {**base, "tools": {"type": "function"}})["param"] == "tools"
    assert _error(tools_url, {**base, "tools": [{"type": "function", "function": {"description": "x"}}]})[
        "param"] == "tools"
    named = {"type": "function", "function": {"name": "get_time"}}
    err = _error(tools_url, {**base, "tools": WEATHER, "tool_choice": named})
    assert err["param"] == "tool_choice" and "get_time" in err["message"]
    assert _error(tools_url, {**base, "tools": WEATHER, "tool_choice": "sometimes"})["param"] == "tool_choice"
    bad_args = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]
    err = _error(tools_url, {**base, "messages": bad_args, "tools": WEATHER})
    assert err["param"] == "messages" and "not valid JSON" in err["message"]
    # still serving
    r = tools_client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=WEATHER, max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_huge_tools_are_over_the_prompt_limit(tools_client, tools_url):
    # 1.5 M enum values: 3 MB of compact JSON, under the 4 MiB body limit, but 4.5 MB of prompt as the template
    # prints the tools (tojson: ", " between items), over the 4 MiB prompt limit although the messages are small
    enum = {"type": "integer", "enum": [0] * 1_500_000}
    tools = [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": enum}}}}]
    body = {"model": MODEL_ID, "messages": ASK, "tools": tools, "max_tokens": 2}
    raw = json.dumps(body, separators=(",", ":")).encode()
    assert len(raw) < 4 << 20
    status, reply = _post(tools_url, raw)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", (status, reply)
    msg = reply["error"]["message"]
    assert msg.startswith("prompt of ") and "of them the tools) is over the limit of 4194304" in msg, msg
    # an earlier call's arguments count the same way (a JSON string in the body, printed by tojson in the prompt)
    args = json.dumps({"n": [0] * 1_500_000}, separators=(",", ":"))
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]}]
    raw = json.dumps({**body, "tools": WEATHER, "messages": history}, separators=(",", ":")).encode()
    assert len(raw) < 4 << 20
    status, reply = _post(tools_url, raw)
    assert status == 400 and reply["error"]["type"] == "invalid_request_error", (status, reply)
    msg = reply["error"]["message"]
    assert msg.startswith("prompt of ") and msg.endswith("of them the tools) is over the limit of 4194304"), msg
    # still serving
    r = tools_client.chat.completions.create(model=MODEL_ID, messages=ASK, tools=WEATHER, max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_a_named_tool_choice_streams_as_it_answers(tools_client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=MODEL_ID, messages=ASK, tools=WEATHER, tool_choice=choice, max_tokens=40, temperature=0)
    whole = tools_client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    if msg.tool_calls:
        # the model closed the call: a parsed call of the named function
        assert [c.function.name for c in msg.tool_calls] == ["get_weather"]
        assert isinstance(json.loads(msg.tool_calls[0].function.arguments), dict)
        assert whole.choices[0].finish_reason in ("tool_calls", "length")
    else:
        # it did not: the text, from the forced opening on, stays content
        assert msg.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')
    chunks = list(tools_client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    assert content == (msg.content or "")
    streamed = [t for d in deltas for t in (d.tool_calls or [])]
    # the same calls (ids are per request)
    assert all(t.id.startswith("call_") for t in streamed)
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in streamed] == [
        (i, c.type, c.function.name, c.function.arguments) for i, c in enumerate(msg.tool_calls or [])]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
