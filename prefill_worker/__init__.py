"""Prefill worker: prefills target (and draft) and pushes the KV to a decode worker."""
