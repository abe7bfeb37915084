"""Decode worker: reserves KV blocks, receives prefilled KV, decodes with the unified step."""
