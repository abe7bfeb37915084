"""Tandem client: the Python SDK (``TandemClient``, ``AsyncTandemClient``) and the
`tandem` command line. Needs grpcio and protobuf only, never torch."""

from tandem_client.connection import Tls
from tandem_client.errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidRequest,
    NotFound,
    Overloaded,
    TandemError,
    Unauthenticated,
    Unavailable,
)
from tandem_client.request import Prompt, SamplingKwargs
from tandem_client.results import (
    Chunk,
    Completion,
    ModelInfo,
    SpeculativeUsage,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from tandem_client.sdk import AsyncTandemClient, TandemClient

__version__ = "0.1.0"

__all__ = [
    "AsyncTandemClient",
    "Cancelled",
    "Chunk",
    "Completion",
    "DeadlineExceeded",
    "InvalidRequest",
    "ModelInfo",
    "NotFound",
    "Overloaded",
    "Prompt",
    "SamplingKwargs",
    "SpeculativeUsage",
    "TandemClient",
    "TandemError",
    "Tls",
    "TokenLogprob",
    "TopLogprob",
    "Unauthenticated",
    "Unavailable",
    "Usage",
    "__version__",
]
