"""The OpenAI-compatible HTTP API of a real server with the real model, driven by the official
`openai` client: completions and chat, streamed and not, against gRPC's output for the same
prompts; vLLM's extra fields; errors; client disconnects; malformed HTTP on both HTTP ports.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tinyvllm.client import AsyncClient

from .conftest import IDLE, HOST, free_port, start_server, wait_for_metrics

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHAT = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    http_port = free_port()
    srv = start_server(tmp_path_factory.mktemp("http"), "--http-port", str(http_port))
    srv.http_port = http_port
    yield srv
    srv.stop()


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"http://{HOST}:{server.http_port}/v1", api_key="unused",
                       max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(server):
    with openai.OpenAI(base_url=f"http://{HOST}:{server.http_port}/v1", api_key="unused") as c:
        (entry,) = c.models.list().data
    return entry.id


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{HOST}:{server.http_port}{path}",
                                 data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def _grpc(server, prompt, **kwargs):
    async with AsyncClient(server.target) as c:
        return await c.complete(prompt, **kwargs)


# --- models, tokenize -----------------------------------------------------------------------------

async def test_models_lists_the_served_model(server, model):
    async with AsyncClient(server.target) as c:
        info = await c.model_info()
    assert model == info.model_name


async def test_tokenize_and_detokenize_match_grpc(server, model):
    async with AsyncClient(server.target) as c:
        ids = await c.tokenize("Hello world")
        chat_ids = await c.tokenize(CHAT)
    status, body = _post(server, "/tokenize", {"model": model, "prompt": "Hello world"})
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == 1024 and len(body["token_strs"]) == len(ids)
    status, body = _post(server, "/tokenize", {"messages": CHAT})
    assert status == 200 and body["tokens"] == chat_ids
    assert _post(server, "/detokenize", {"tokens": ids}) == (200, {"prompt": "Hello world"})
    status, body = _post(server, "/detokenize", {"tokens": [10**7]})
    assert status == 400 and body["error"]["param"] == "token_ids"
    status, body = _post(server, "/tokenize", {"prompt": "a", "messages": CHAT})
    assert status == 400 and body["error"]["param"] == "prompt"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("prompt: ")


# --- generation equals gRPC's --------------------------------------------------------------------

@pytest.mark.parametrize("prompt", PROMPTS[:2])
async def test_greedy_completion_matches_grpc(server, client, model, prompt):
    expected = await _grpc(server, prompt, temperature=0.0, max_tokens=12)
    got = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=12)
    assert got.choices[0].text == expected.text
    assert got.choices[0].finish_reason == expected.finish_reason == "length"
    assert got.usage.completion_tokens == 12
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    assert got.usage.total_tokens == got.usage.prompt_tokens + 12
    assert got.object == "text_completion" and got.model == model

    chunks = list(client.completions.create(model=model, prompt=prompt, temperature=0,
                                            max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


async def test_chat_matches_grpc_streamed_and_not(server, client, model):
    expected = await _grpc(server, CHAT, temperature=0.0, max_tokens=10)
    got = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                         max_tokens=10)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
    assert got.usage.completion_tokens == expected.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                                 max_completion_tokens=10, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    # content given as text parts is the same conversation
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name three "},
                                          {"type": "text", "text": "colors."}]}]
    again = client.chat.completions.create(model=model, messages=parts, temperature=0,
                                           max_tokens=10)
    assert again.choices[0].message.content == expected.text


async def test_vllm_extra_sampling_fields(server, client, model):
    prompt = PROMPTS[0]
    ids = (await _grpc(server, prompt, temperature=0.0, max_tokens=6)).token_ids
    # stop_token_ids / ignore_eos / min_tokens / top_k / min_p / repetition_penalty / seed
    got = client.completions.create(model=model, prompt=prompt, temperature=0, max_tokens=6,
                                    extra_body={"stop_token_ids": [ids[2]]})
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == 3
    assert got.choices[0].model_extra["stop_reason"] == ids[2]
    sampled = [client.completions.create(
        model=model, prompt=prompt, max_tokens=8, temperature=1.0, seed=1234,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True,
                    "min_tokens": 8}).choices[0].text for _ in range(2)]
    assert sampled[0] == sampled[1]
    expected = await _grpc(server, prompt, max_tokens=8, temperature=1.0, seed=1234, top_k=20,
                           min_p=0.05, repetition_penalty=1.2, ignore_eos=True, min_tokens=8)
    assert sampled[0] == expected.text
    stopped = client.completions.create(model=model, prompt="Count: 1, 2, 3,", temperature=0,
                                        max_tokens=10, stop=[","])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["stop_reason"] == ","
    assert "," not in stopped.choices[0].text


async def test_logprobs_in_openai_shapes(client, model):
    c = client.completions.create(model=model, prompt=PROMPTS[1], temperature=0, max_tokens=4,
                                  logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 and max(top.values()) <= 0 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=model, messages=CHAT, temperature=0,
                                          max_tokens=4, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)
    # greedy: the chosen token is the most likely one
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob) for e in content)


async def test_prompt_logprobs_as_vllm_returns_them(client, model):
    c = client.completions.create(model=model, prompt=PROMPTS[1], temperature=0, max_tokens=2,
                                  extra_body={"prompt_logprobs": 1})
    entries = c.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == c.usage.prompt_tokens
    for entry in entries[1:]:  # the prompt token (any rank) and the most likely one
        assert 1 <= len(entry) <= 2 and all(v["logprob"] <= 0 for v in entry.values())
        assert any(v["rank"] == 1 for v in entry.values())
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


# --- errors ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=2), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(extra_body={"top_k": "many"}), "top_k"),
    (dict(extra_body={"no_such_field": 1}), "no_such_field"),
    (dict(extra_body={"stop_token_ids": [-1]}), "stop_token_ids"),
    (dict(extra_body={"seed": 2**70}), "seed"),
    (dict(extra_body={"stream_options": {"include_usage": "maybe"}}),
     "stream_options.include_usage"),
    (dict(prompt=["a", "b"]), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="word " * 2000), "prompt"),
])
def test_bad_completion_fields_are_400_naming_the_field(client, model, kwargs, param):
    args = dict(model=model, prompt="Hi", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**args)
    err = info.value.body
    assert info.value.status_code == 400
    assert err["type"] == "invalid_request_error"
    assert err["param"] is not None and err["param"].startswith(param), err
    assert err["message"].startswith(err["param"])


def test_chat_and_model_errors(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[], max_tokens=2)
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    assert info.value.body["param"] == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=[{"content": "no role"}])
    assert info.value.body["param"] == "messages[0].role"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-nothing", prompt="Hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"


def test_invalid_json_body_is_400(server):
    req = urllib.request.Request(f"http://{HOST}:{server.http_port}/v1/completions",
                                 data=b"{not json", headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=10)
    assert info.value.code == 400
    assert "not valid JSON" in json.loads(info.value.read())["error"]["message"]


# --- client disconnect aborts the request ---------------------------------------------------------

def _aborts(server) -> float:
    return server.metrics().get("tinyvllm:request_success_total{finished_reason=abort}", 0.0)


def test_disconnect_mid_stream_aborts_in_engine(server, client, model):
    before = _aborts(server)
    stream = client.completions.create(model=model, prompt="Tell me a long story.",
                                       max_tokens=900, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    wait_for_metrics(server, {**IDLE, "tinyvllm:request_success_total{finished_reason=abort}":
                              before + 1}, timeout_s=20)


def test_disconnect_while_waiting_non_streaming_aborts_in_engine(server, model):
    before = _aborts(server)
    with openai.OpenAI(base_url=f"http://{HOST}:{server.http_port}/v1", api_key="unused",
                       max_retries=0, timeout=1.5) as impatient:
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model=model, prompt="Tell me a long story.",
                                         max_tokens=900, temperature=0,
                                         extra_body={"ignore_eos": True})
    wait_for_metrics(server, {**IDLE, "tinyvllm:request_success_total{finished_reason=abort}":
                              before + 1}, timeout_s=20)


# --- malformed HTTP gets a 4xx, on both HTTP ports ------------------------------------------------

def _raw(port: int, data: bytes, half_close: bool = False, timeout_s: float = 20.0) -> bytes:
    with socket.create_connection((HOST, port), timeout=timeout_s) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
        return reply


def _status(reply: bytes) -> int:
    assert reply.startswith(b"HTTP/1.1 "), reply[:100]
    return int(reply.split(b" ", 2)[1])


MALFORMED = {
    "100KB header": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 +
                     b"\r\n\r\n", False, 431),
    "100KB header in pieces": (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000,
                               True, 400),
    "no CRLFCRLF, then EOF": (b"GET /health HTTP/1.1\r\nHost: x\r\n", True, 400),
    "garbage": (b"\x16\x03\x01 hello\r\n\r\n", False, 400),
    "no CRLFCRLF, connection held open": (b"GET /health HTTP/1.1\r\nHost: x\r\n", False, 408),
}


@pytest.mark.parametrize("port_name", ["metrics_port", "http_port"])
def test_malformed_requests_get_4xx(server, port_name):
    port = getattr(server, port_name)
    results: dict[str, int] = {}

    def probe(name: str) -> None:
        data, half_close, _ = MALFORMED[name]
        results[name] = _status(_raw(port, data, half_close))

    threads = [threading.Thread(target=probe, args=(n,)) for n in MALFORMED]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results == {name: expected for name, (_, _, expected) in MALFORMED.items()}
    assert time.monotonic() - start < 20
    # The port still serves well-formed requests afterwards.
    assert _status(_raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")) \
        == 200
