"""A decode worker's stream of one request: its cumulative outputs as consecutive chunks,
continuing where an earlier attempt (or the router, with the first token) left off."""

from __future__ import annotations

from decode_worker.request import RequestHandle
from engine.llm_engine import RequestOutput
from engine.sequence import FinishReason, SpecCounts
from serving.sampling import finish_reason_to_proto, token_logprob_to_proto
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb


class ChunkStream:
    """Turns one request's cumulative outputs into consecutive chunks."""

    def __init__(self, req: RequestHandle, request: pb.DecodeRequest) -> None:
        self.req = req
        # Chunks continue where an earlier attempt's stream stopped, text included.
        self.num_sent = req.num_output_tokens_sent  # tokens already in chunks (by any attempt)
        self.num_text_sent = req.num_output_chars_sent  # characters already in chunks
        self.first_logprob = (
            request.first_token_logprob if request.HasField("first_token_logprob") else None
        )
        # This attempt's speculative counters so far; None without a draft. A preempted
        # attempt reports its own on its last chunk, and the router adds them up.
        self.spec_counts: SpecCounts | None = None

    def chunk(self, output: RequestOutput) -> gen.GenerateChunk:
        tokens = output.token_ids[self.num_sent :]
        chunk = gen.GenerateChunk(
            request_id=self.req.request_id,
            index=self.num_sent,
            token_ids=tokens,
            text=output.text[self.num_text_sent :],
        )
        if self.req.logprobs is not None:
            chunk.logprobs.extend(self._logprobs(output, self.num_sent, len(tokens)))
        self.num_sent += len(tokens)
        self.num_text_sent = len(output.text)
        self.spec_counts = output.spec_counts
        if output.finished:
            chunk.finish_reason = finish_reason_to_proto(output.finish_reason)
            if isinstance(output.stop_reason, int):
                chunk.stop_token_id = output.stop_reason
            elif isinstance(output.stop_reason, str):
                chunk.stop_string = output.stop_reason
            chunk.usage.CopyFrom(self._usage(len(output.token_ids)))  # the router adds
            # the cached tokens, the prefill worker's figure
        return chunk

    def sent_by_router(self, first: RequestOutput, text: str) -> None:
        """The router streamed the first token with ``text`` from the prefill worker's
        reply: chunks start after them. ``text`` is a prefix of this worker's text of the
        token where both workers detokenize alike (empty where the prefill worker has no
        tokenizer: this worker's text of it then comes with the next chunk)."""
        if not first.text.startswith(text):
            raise RuntimeError(
                f"first_text: the router sent {text!r}, this worker makes {first.text!r} of "
                "the same token: the prefill and decode workers' tokenizers differ"
            )
        self.num_sent = len(first.token_ids)
        self.num_text_sent = len(text)

    def preempted(self) -> gen.GenerateChunk:
        """The last chunk of a request handed back: the router resumes it elsewhere, and
        adds this attempt's speculative counters to the next ones'."""
        return gen.GenerateChunk(
            request_id=self.req.request_id,
            index=self.num_sent,
            finish_reason=finish_reason_to_proto(FinishReason.PREEMPTED),
            usage=self._usage(self.num_sent),
        )

    def aborted(self) -> gen.GenerateChunk:
        """The last chunk of a request aborted here."""
        return gen.GenerateChunk(
            request_id=self.req.request_id,
            index=self.num_sent,
            finish_reason=finish_reason_to_proto(FinishReason.ABORT),
            usage=self._usage(self.num_sent),
        )

    def _usage(self, num_completion_tokens: int) -> gen.Usage:
        """Token counts, with the speculative counters when a draft ran."""
        usage = gen.Usage(
            prompt_tokens=self.req.num_prompt_tokens, completion_tokens=num_completion_tokens
        )
        counts = self.spec_counts
        if counts is not None:
            usage.speculative.CopyFrom(
                gen.SpeculativeUsage(
                    num_drafts=counts.num_drafts,
                    num_draft_tokens=counts.num_draft_tokens,
                    num_accepted_tokens=counts.num_accepted_tokens,
                    num_steps_without_drafts=counts.num_steps_without_drafts,
                )
            )
        return usage

    def _logprobs(self, output: RequestOutput, start: int, count: int) -> list[gen.TokenLogprob]:
        """Index r (the tokens resumed before it) was sampled by the prefill worker, which
        sent its logprobs; index i > r is output.logprobs[i - r - 1]."""
        entries = []
        first = self.req.num_output_tokens_sent
        for i in range(start, start + count):
            token = output.token_ids[i]
            if i == first:
                entries.append(self.first_logprob or gen.TokenLogprob(token_id=token))
            elif 0 <= i - first - 1 < len(output.logprobs):
                entries.append(token_logprob_to_proto(output.logprobs[i - first - 1]))
            else:
                entries.append(gen.TokenLogprob(token_id=token))
        return entries
