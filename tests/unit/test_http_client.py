import asyncio
import ssl

from tether.http.client import async_client, tls_context


def test_clients_share_one_tls_context_made_once():
    first = tls_context()
    assert isinstance(first, ssl.SSLContext)
    assert tls_context() is first
    assert first.verify_mode == ssl.CERT_REQUIRED  # httpx's default: certificates are still checked


def test_async_client_keeps_the_timeout_and_options():
    async def make():
        async with async_client(7.5, follow_redirects=True) as client:
            return client.timeout.read, client.follow_redirects

    assert asyncio.run(make()) == (7.5, True)
