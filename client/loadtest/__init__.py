"""Tandem's load-test harness (`tandem loadtest`, installed with ``tandem-client[loadtest]``):
measure a Tandem router over gRPC, or any OpenAI-compatible server over HTTP, with the same
requests, arrivals and metrics, so that one run compares Tandem with another server.

Parts, one concern each: ``targets`` (send one request, time its chunks), ``arrivals``
(when requests start), ``data`` (what they ask), ``runner`` (the load itself), ``metrics``
(pure functions of the timings), ``speculative`` (accepted tokens per step, from usage or
/metrics), ``report`` (summary screen and JSON), ``output`` and ``plots`` (the files of
--output-dir) and ``cli`` (the command). Needs the client and the extra's packages (openai,
tqdm, rich; matplotlib for plots); never torch."""
