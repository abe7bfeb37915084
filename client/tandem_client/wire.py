"""What the wire contract declares beyond its messages: metadata keys and request limits.

Every side of the wire reads these from here (the router, both workers, the SDK), so a
limit is declared once, next to the generated `tandem.v1` stubs it constrains.
"""

from __future__ import annotations

# Trailing metadata on a status raised by a refused KV push: the wire KvPushStatus name,
# so a caller two hops up (the router, behind the prefill worker) tells "D refused P's
# push" from "P broke" without reading the message.
KV_PUSH_STATUS_KEY = "tandem-kv-push-status"
