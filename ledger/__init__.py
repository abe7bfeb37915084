"""What the services share: the Redis ledger, its audit, and a private redis-server."""
