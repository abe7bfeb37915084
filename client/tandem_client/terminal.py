"""Printing an answer as it streams, and the line of figures that follows it on stderr
(`tandem generate` and `tandem chat`)."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tandem_client.results import Chunk, Usage


@dataclass(frozen=True)
class Streamed:
    """An answer printed to the end."""

    text: str
    num_tokens: int
    first_token_s: float | None  # from the call to the first token; None without any
    elapsed_s: float
    finish_reason: str | None
    usage: Usage | None

    def stats_line(self) -> str:
        """Tokens, time to first token, throughput, prompt size and how it ended."""
        first = f"{1e3 * self.first_token_s:.0f} ms" if self.first_token_s is not None else "-"
        rate = self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0
        parts = [
            f"{self.num_tokens} tokens in {self.elapsed_s:.2f} s, first after {first}, "
            f"{rate:.1f} tok/s"
        ]
        if self.usage is not None:
            parts.append(f"prompt {self.usage.prompt_tokens} tokens")
            spec = self.usage.speculative
            if spec is not None and spec.num_drafts:
                parts.append(f"mean accepted length {spec.mean_accepted_length:.2f}")
        parts.append(f"finish: {self.finish_reason}")
        return f"[{'; '.join(parts)}]"


def print_stream(
    chunks: Iterator[Chunk], started: float, received: Sequence[Chunk] = ()
) -> Streamed:
    """Prints each chunk's text as it comes (``received``: those already taken from
    ``chunks``, first), then a newline; ``started`` is the ``time.perf_counter()`` of the
    call. An exception (Ctrl-C) closes the stream, which cancels the request on the server."""
    texts: list[str] = []
    num_tokens = 0
    first: float | None = None
    last: Chunk | None = None
    is_done = False
    try:
        for chunk in itertools.chain(received, chunks):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - started
            num_tokens += len(chunk.token_ids)
            texts.append(chunk.text)
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            last = chunk
        is_done = True
    finally:
        close = getattr(chunks, "close", None)  # the SDK's stream is a generator
        if close is not None:
            close()
        if is_done or texts:  # an answer cut short still ends its line
            sys.stdout.write("\n")
            sys.stdout.flush()
    return Streamed(
        text="".join(texts),
        num_tokens=num_tokens,
        first_token_s=first,
        elapsed_s=time.perf_counter() - started,
        finish_reason=last.finish_reason if last else None,
        usage=last.usage if last else None,
    )
