"""How the worker reads SGLang's and routers' answers, in process."""

from __future__ import annotations

import orjson
import pytest

from common.settings import Settings
from worker.sglang import Busy, PermanentError, Server, SGLangClient, TransientError


@pytest.fixture
def client() -> SGLangClient:
    return SGLangClient(Settings())


def test_refusals_of_one_request_are_busy_not_down(client: SGLangClient):
    server = Server("http://gpu-1:30000", healthy=True)
    for status in (408, 429, 502, 503, 504):
        with pytest.raises(Busy) as busy:
            client._parse(server, status, b'{"error": "queue full"}', 1.5)
        assert busy.value.retry_after == 1.5
    assert server.healthy  # only a failing /health_generate or a refused connection marks a server down
    with pytest.raises(PermanentError, match="HTTP 400"):
        client._parse(server, 400, b'{"error": {"message": "too long"}}')


def test_an_abort_from_the_waiting_queue_is_an_abort(client: SGLangClient):
    # SGLang answers a request aborted while still queued with HTTP 200 and no token counts.
    body = {"text": "", "output_ids": [], "meta_info": {"id": "r", "finish_reason": {"type": "abort", "message": "x"}}}
    with pytest.raises(TransientError, match="generation ended with 'abort'"):
        client._parse(Server("http://gpu-1:30000"), 200, orjson.dumps(body))
