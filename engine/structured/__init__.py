"""Structured output: per-request JSON schema, regex or EBNF grammars (through xgrammar)
turned into token bitmasks for sampling, verification and drafting."""
