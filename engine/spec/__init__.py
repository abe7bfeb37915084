"""Speculative decoding: drafters, lossless acceptance and the unified decode step."""
