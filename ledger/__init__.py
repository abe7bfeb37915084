"""The Redis ledger: request state, block ownership under leases, the worker registry and
membership, the audit against workers' allocators, and a private redis-server. No torch."""
