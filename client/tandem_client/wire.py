"""What the wire contract declares beyond its messages: metadata keys and request limits.

Every side of the wire reads these from here (the router, both workers, the SDK), so a
limit is declared once, next to the generated `tandem.v1` stubs it constrains.
"""

from __future__ import annotations

# Trailing metadata on a status raised by a refused KV push: the wire KvPushStatus name,
# so a caller two hops up (the router, behind the prefill worker) tells "D refused P's
# push" from "P broke" without reading the message.
KV_PUSH_STATUS_KEY = "tandem-kv-push-status"

# Trailing metadata on RESOURCE_EXHAUSTED: milliseconds after which a retry may find room
# (the HTTP API sends it as Retry-After, in whole seconds).
RETRY_AFTER_MS_KEY = "tandem-retry-after-ms"
DEFAULT_RETRY_AFTER_S = 1.0

# Request limits of tandem.v1.SamplingParams, checked by the router before any worker sees
# a request. The engine's SamplingParams enforces the same ranges on the worker side;
# tests/router/test_sampling_limits.py keeps the two equal.
DEFAULT_MAX_TOKENS = 16  # max_tokens when unset
MIN_MAX_TOKENS = 1
MAX_TEMPERATURE = 100.0  # temperature in [0, MAX_TEMPERATURE]; 0 is greedy
MAX_SEED = 2**63  # seed in [0, MAX_SEED): a signed 64-bit integer on every side
MAX_STOP_SEQUENCES = 16
MAX_THINKING_END = 64  # characters of structured_output.thinking_end
MAX_LOGPROBS = 20  # logprobs in [0, MAX_LOGPROBS]
# prompt_logprobs in [0, MAX_PROMPT_LOGPROBS]; with it set, max_tokens may be 0 (score only)
MAX_PROMPT_LOGPROBS = 20
MAX_FREQUENCY_PENALTY = 2.0  # frequency_penalty and presence_penalty in [-2, 2]
MAX_REPETITION_PENALTY = 100.0  # repetition_penalty in (0, 100]; 1 is off
MAX_LOGIT_BIAS = 100.0  # each logit_bias value in [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300
