"""The SDK's clients with no server behind them (a port nothing listens on): a closed client says
so, timeout=0 is a deadline already past (not the client's default), an API key read from a file
keeps no newline, TLS material comes as PEM bytes, PEM text or a file, and a client certificate
without its key names the SDK's parameters."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest

from client import AsyncClient, Client, PdserveError
from client.routers import connection

NOWHERE = "127.0.0.1:1"  # refused at once: UNAVAILABLE, where a deadline not yet past is given
MSGS = [{"role": "user", "content": "hi"}]


def _closed(e: pytest.ExceptionInfo) -> bool:
    return e.value.code == grpc.StatusCode.FAILED_PRECONDITION and e.value.message == "the client is closed"


def test_a_closed_client_says_so():
    c = Client(NOWHERE, timeout=5)
    c.close()
    c.close()  # again: nothing
    calls = (
        lambda: c.generate(prompt_token_ids=[1], max_tokens=2),
        lambda: c.stream(prompt_token_ids=[1]),
        c.list_models,
        lambda: c.wait_ready(timeout=1),
        lambda: c.chat(MSGS, model="m"),
    )
    for call in calls:
        with pytest.raises(PdserveError) as e:
            call()
        assert _closed(e), e.value


def test_a_closed_async_client_says_so():
    async def run() -> None:
        c = AsyncClient(NOWHERE, timeout=5)
        await c.close()
        await c.close()

        async def stream() -> None:
            async for _ in c.stream(prompt_token_ids=[1]):
                pass

        for call in (
            lambda: c.generate(prompt_token_ids=[1], max_tokens=2),
            stream,
            c.list_models,
            lambda: c.wait_ready(timeout=1),
            lambda: c.chat(MSGS, model="m"),
        ):
            with pytest.raises(PdserveError) as e:
                await call()
            assert _closed(e), e.value

    asyncio.run(run())


@pytest.fixture()
def silent():
    """host:port of a socket that is listened on and never answers: a call waits out its deadline."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def _past(e: pytest.ExceptionInfo, t0: float) -> None:
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 2.5, e.value


def test_timeout_zero_is_a_deadline_already_past(silent):
    with Client(silent, timeout=5) as c:
        for call in (lambda: c.generate(prompt_token_ids=[1], timeout=0), lambda: c.list_models(timeout=0)):
            t0 = time.monotonic()
            with pytest.raises(PdserveError) as e:
                call()
            _past(e, t0)

    async def aio() -> None:
        async with AsyncClient(silent, timeout=5) as c:
            for call in (lambda: c.generate(prompt_token_ids=[1], timeout=0), lambda: c.list_models(timeout=0)):
                t0 = time.monotonic()
                with pytest.raises(PdserveError) as e:
                    await call()
                _past(e, t0)

    asyncio.run(aio())
    with pytest.raises(TypeError, match="timeout must be a number"):
        Client(NOWHERE, timeout="5")


def test_an_api_key_keeps_no_surrounding_whitespace(monkeypatch):
    assert connection("sk-key\n", None, None, None, None)[0] == (("authorization", "Bearer sk-key"),)
    assert connection("  ", None, None, None, None)[0] == ()
    monkeypatch.setenv("PDSERVE_API_KEY", " sk-env ,other")
    assert connection(None, None, None, None, None)[0] == (("authorization", "Bearer sk-env"),)
    for bad in ("sk\x00key", "sk-clé", "a\nb"):
        with pytest.raises(ValueError, match="api_key: an API key is printable ASCII"):
            Client(NOWHERE, api_key=bad)
    with pytest.raises(TypeError, match="api_key must be a str"):
        Client(NOWHERE, api_key=b"sk-key")


def test_tls_material_is_pem_bytes_pem_text_or_a_file(tmp_path):
    from tests.helpers.tls_ca import CA

    ca = CA(tmp_path)
    pem = Path(ca.ca).read_bytes()
    for given in (pem, pem.decode(), ca.ca, Path(ca.ca)):
        tls = connection(None, given, None, None, None)[1]
        assert tls is not None and tls.ca == pem, type(given)
    with pytest.raises(ValueError, match=r"tls_ca .*nope\.pem"):
        connection(None, str(tmp_path / "nope.pem"), None, None, None)
    for cert, key in ((pem, None), (None, pem)):
        with pytest.raises(ValueError, match="tls_cert and tls_key go together") as e:
            Client(NOWHERE, tls_ca=pem, tls_cert=cert, tls_key=key)
        assert "--" not in str(e.value)
