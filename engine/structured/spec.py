"""What a request constrains its output to; no torch and no xgrammar here (the router
imports it)."""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "json_schema", "regex", "grammar")


class GrammarError(ValueError):
    """A constraint that does not compile (or not in time); the message names the field."""


@dataclass(frozen=True)
class StructuredOutput:
    """``kind``: "json" (any JSON object), "json_schema" (``value`` a JSON schema),
    "regex" or "grammar" (``value`` EBNF in GBNF style, root rule ``root``)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(
                f"structured_output: kind {self.kind!r} is not one of {', '.join(KINDS)}"
            )
        if self.kind != "json" and not self.value:
            raise GrammarError(f"{self.field}: is empty")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.value)
            except ValueError as e:
                raise GrammarError(f"{self.field}: is not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise GrammarError(f"{self.field}: must be a JSON object")

    @property
    def field(self) -> str:
        """The wire's field that carries it (tandem.v1.StructuredOutput), for errors."""
        name = "json_object" if self.kind == "json" else self.kind
        return f"structured_output.{name}"
