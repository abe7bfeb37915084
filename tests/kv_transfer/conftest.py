"""The KV-transfer tests' receiving server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.kv_transfer.kv_pools import Receiving


@pytest.fixture
async def receiving() -> AsyncIterator[Receiving]:
    r = Receiving()
    await r.server.start()
    yield r
    await r.channel.close()
    await r.server.stop(0)
