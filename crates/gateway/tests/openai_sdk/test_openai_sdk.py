"""`kvroute gateway` driven by the official `openai` Python SDK, as an application would, in front
of two mock engines (`kvroute fake-engine --openai`): completions, chat (streamed with the usage
on its last chunk, with tools, with n choices), the Responses API, and each error class the SDK
raises. Retries are off (`max_retries=0`), so each error is the gateway's first answer."""

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest

from conftest import MODEL, Fleet, active_bookings, free_port, post_json, wait_until

PROMPT = "Once upon a time, in a land far away, there lived a router that remembered every prompt."


@pytest.fixture
def client(fleet):
    return openai.OpenAI(base_url=f"{fleet.base}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(autouse=True)
def no_booking_left(fleet):
    yield
    wait_until("every booking freed", lambda: active_bookings(fleet.base) == 0, timeout_s=10)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL]


def test_a_repeated_completion_returns_to_its_worker_and_hits_the_cache(client):
    first = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    completion = first.parse()
    assert completion.object == "text_completion"
    assert completion.choices[0].finish_reason == "length"
    assert completion.choices[0].text
    assert completion.usage.completion_tokens == 5
    second = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert second.headers["x-kvroute-worker-id"] == first.headers["x-kvroute-worker-id"]
    usage = second.parse().usage
    assert usage.prompt_tokens_details.cached_tokens >= 16 * ((usage.prompt_tokens - 1) // 16) > 0


def test_chat(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_completion_tokens=6,
    )
    assert chat.object == "chat.completion"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content
    assert chat.usage.completion_tokens == 6


def test_a_streamed_chat_carries_the_usage_on_its_last_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me a story."}],
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 7
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert len(text) == 7
    assert chunks[-2].choices[0].finish_reason == "length"


def test_a_chat_with_tools_is_served(client):
    tools = [{
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=tools,
        tool_choice="auto",
        max_tokens=4,
    )
    assert chat.choices[0].message.content
    # A follow-up turn carrying the tool call and its result.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        tools=tools,
        max_tokens=4,
    )
    assert chat.usage.completion_tokens == 4


def test_n_choices(client):
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, n=3)
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert completion.usage.completion_tokens == 9
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, n=2, stream=True,
    ))
    assert {c.choices[0].index for c in chunks} == {0, 1}


def test_benchmark_clients_fields_pass(client):
    # What aiperf, guidellm and inference-perf send to fix the output length.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_completion_tokens=5,
        extra_body={"ignore_eos": True, "min_tokens": 5},
    )
    assert chat.usage.completion_tokens == 5


def test_responses(client):
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input="What is a router?", max_output_tokens=8
    )
    assert response.object == "response"
    assert response.status == "completed"
    assert response.output_text
    assert response.usage.output_tokens == 8
    # Input items, as a multi-turn conversation sends them.
    response = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "What is a router?"}]},
            {"role": "assistant", "content": "A thing that picks."},
            {"role": "user", "content": "And a gateway?"},
        ],
        max_output_tokens=3,
    )
    assert response.usage.output_tokens == 3


def test_a_streamed_response_relays_its_events(client):
    events = list(client.responses.create(
        model=MODEL, input="Stream me a story.", max_output_tokens=6, stream=True
    ))
    types = [e.type for e in events]
    assert types[0] == "response.created"
    assert types[-1] == "response.completed"
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 6
    assert events[-1].response.usage.output_tokens == 6
    assert events[-1].response.output[0].content[0].text == "".join(deltas)


def test_a_wrong_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert caught.value.param == "model"
    assert "retry-after" not in caught.value.response.headers
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")


@pytest.mark.parametrize(
    "call, param",
    [
        (lambda c: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=-1), "max_tokens"),
        (lambda c: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2.5), "max_tokens"),
        (lambda c: c.completions.create(model=MODEL, prompt={"a": 1}), "prompt"),
        (lambda c: c.completions.create(model=MODEL, prompt=PROMPT, n=0), "n"),
        (lambda c: c.chat.completions.create(model=MODEL, messages="hi"), "messages"),
        (lambda c: c.chat.completions.create(model=MODEL, messages=[]), "messages"),
        (lambda c: c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], stream_options={"include_usage": True}),
         "stream_options"),
        (lambda c: c.responses.create(model=MODEL, input=7), "input"),
    ],
)
def test_a_malformed_body_is_a_bad_request_naming_the_field(client, call, param):
    with pytest.raises(openai.BadRequestError) as caught:
        call(client)
    error = caught.value
    assert error.param == param, error.message
    assert error.type == "invalid_request_error"
    assert "retry-after" not in error.response.headers


def test_a_body_that_is_not_json_is_a_bad_request(fleet):
    request = urllib.request.Request(
        f"{fleet.base}/v1/chat/completions", data=b'{"model": "default", "messages": [',
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=5)
    assert caught.value.code == 400
    error = json.load(caught.value)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None
    assert "not valid JSON" in error["message"]


def test_an_unreachable_worker_is_an_internal_server_error_with_retry_after(fleet, client):
    # A model whose one worker is not listening: every attempt fails to connect.
    port = free_port()
    assert post_json(f"{fleet.base}/workers", {
        "worker_id": 4242, "model_name": "ghost", "endpoint": f"http://127.0.0.1:{port}",
        "block_size": 16,
    }) == 201
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model="ghost", prompt=PROMPT, max_tokens=2)
    assert caught.value.status_code == 503
    assert caught.value.response.headers["retry-after"]
    assert caught.value.type == "service_unavailable"


def test_every_worker_busy_is_a_rate_limit_error_with_retry_after():
    # One engine that holds each request a minute before its first token, and a gateway that
    # counts a worker busy from its first prompt token in prefill.
    fleet = Fleet(
        engines=1,
        engine_flags=["--first-token-delay-ms", "60000"],
        gateway_flags=["--busy-prefill-tokens", "1"],
    )
    try:
        client = openai.OpenAI(base_url=f"{fleet.base}/v1", api_key="unused", max_retries=0, timeout=5)
        holder = threading.Thread(
            target=lambda: pytest.raises(openai.APITimeoutError, client.completions.create,
                                         model=MODEL, prompt=PROMPT, max_tokens=2),
            daemon=True,
        )
        holder.start()
        wait_until("the first request booked", lambda: active_bookings(fleet.base) == 1)
        with pytest.raises(openai.RateLimitError) as caught:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert caught.value.response.headers["retry-after"]
        assert caught.value.type == "rate_limit_exceeded"
        holder.join(timeout=30)
        # The first client gave up: its booking is freed.
        wait_until("the booking freed", lambda: active_bookings(fleet.base) == 0, timeout_s=10)
    finally:
        fleet.stop()
