"""The OpenAI-compatible HTTP API the router serves beside gRPC (see app.py)."""
