"""HTTP the server cannot parse gets OpenAI's JSON error (not uvicorn's plain text), and the gateway keeps serving.

The bytes go through a raw socket: no client library would send them. Each malformed request is
answered 400 with an OpenAI-shaped body and its connection is closed; a call cut by its malformed
body publishes nothing.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from trajbus.streams.wire.topics import steps_topic
from tests.helpers import decode_step_events, read_to_end

CHUNKED = b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
MALFORMED = {
    "a request line that is not HTTP": b"NOT AN HTTP REQUEST\r\n\r\n",
    "a header without a colon": b"GET /health HTTP/1.1\r\nHost: gw\r\nno colon here\r\n\r\n",
    "a control character in a header value": b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Note: a\x01b\r\n\r\n",
    "a non-ASCII path": b"GET /caf\xc3\xa9 HTTP/1.1\r\nHost: gw\r\n\r\n",
    "Content-Length beside chunked": b"POST /init_trajectory HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n" + CHUNKED
                                     + b"2\r\n{}\r\n0\r\n\r\n",
    "an invalid chunk size": b"POST /init_trajectory HTTP/1.1\r\nHost: gw\r\n" + CHUNKED + b"ZZ\r\n{}\r\n0\r\n\r\n",
}


def exchange(address: tuple[str, int], raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` and read the answer until the server closes the connection (10 s at most)."""
    with socket.create_connection(address, timeout=10) as sock:
        sock.sendall(raw)
        data = b""
        while chunk := sock.recv(65536):  # a timeout fails the test: the server must answer and close
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    return int(status_line.split()[1]), headers, body


def assert_openai_400(status: int, headers: dict[str, str], body: bytes) -> None:
    assert status == 400, (status, headers, body)
    assert headers["content-type"] == "application/json", headers
    assert int(headers["content-length"]) == len(body) and headers["connection"] == "close", headers
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_http_request", None)


def test_malformed_http_gets_an_openai_error_and_the_gateway_keeps_serving(
        bootstrap_servers, prefix, scripted_engine, start_gateway, tiny_model_dir):
    from transformers import AutoTokenizer

    engine, _ = scripted_engine(["Four."])
    gateway, process = start_gateway([engine])
    address = (urlsplit(gateway).hostname, urlsplit(gateway).port)
    t = httpx.post(f"{gateway}/init_trajectory", json={"prompt_uid": "malformed", "n_rollouts": 1}).json()
    chat_path = urlsplit(t["base_url"]).path.encode() + b"/chat/completions"

    for what, raw in MALFORMED.items():
        try:
            assert_openai_400(*exchange(address, raw))
        except (AssertionError, KeyError, ValueError) as exc:
            pytest.fail(f"{what}: {exc!r}")
    # A chat call whose chunked body breaks off is answered the same way, and publishes nothing.
    cut = b"POST " + chat_path + b" HTTP/1.1\r\nHost: gw\r\n" + CHUNKED + b"10\r\n{\"messages\": []}\r\nXYZ\r\n"
    assert_openai_400(*exchange(address, cut))

    assert process.alive(), process.log_tail()
    reply = httpx.post(f"{t['base_url']}/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 2?"}]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "Four."
    steps = decode_step_events(read_to_end(bootstrap_servers, steps_topic("train", prefix)))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert [(s.trajectory_uid, tokenizer.decode(s.response_ids[:-1])) for s in steps] == \
        [(t["trajectory_uid"], "Four.")], "only the well-formed call published a step"
