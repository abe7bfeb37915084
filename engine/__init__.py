"""Tandem's single-device engine: configs, weights, models, paged KV cache, scheduling, sampling."""
