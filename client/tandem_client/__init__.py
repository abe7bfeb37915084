"""Tandem client: Python SDK and the `tandem` command line."""

__version__ = "0.1.0"
