"""Data preparation for training speculative-decoding draft models."""
