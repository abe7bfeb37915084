"""helm/tandem/README.md's table documents every key of values.yaml, and names no key
that values.yaml lacks."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml

from tests.helm.chart import CHART_DIR

ROLES = ("router", "prefill", "decode")
# Values whose content is free-form Kubernetes (documented as one key).
OPAQUE = {"resources", "podSecurityContext", "securityContext"}


def value_keys(values: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and key not in OPAQUE:
            yield from value_keys(value, f"{path}.")
        else:
            yield path


def documented_keys() -> tuple[set[str], set[str]]:
    """Keys in the first column of the README's values table, and the ROLE.* suffixes:
    `a.b`, `.c` (a sibling of the key before it in the row), `x.*` (a whole section),
    `ROLE.k` (the key k of each role that has it)."""
    text = (CHART_DIR / "README.md").read_text()
    table = text.split("## Values", 1)[1].split("\n## ", 1)[0]
    keys: set[str] = set()
    role_keys: set[str] = set()
    for row in re.findall(r"^\| (`[^|]*) \|", table, flags=re.M):
        previous = ""
        for key in re.findall(r"`([^`]+)`", row):
            if key.startswith("."):
                key = previous.rsplit(".", 1)[0] + key
            previous = key
            if key.startswith("ROLE."):
                role_keys.add(key.removeprefix("ROLE."))
            else:
                keys.add(key)
    return keys, role_keys


def test_every_value_is_documented_and_every_documented_key_exists() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    actual = set(value_keys(values))
    keys, role_keys = documented_keys()
    sections = {k.removesuffix(".*") for k in keys if k.endswith(".*")}
    documented = {k for k in keys if not k.endswith(".*")}
    documented |= {f"{role}.{k}" for role in ROLES for k in role_keys}
    documented |= {k for k in actual if any(k.startswith(f"{s}.") for s in sections)}
    missing = sorted(actual - documented)
    assert missing == [], f"values without a row in helm/tandem/README.md: {missing}"
    unknown = sorted(k for k in keys - actual if not k.endswith(".*"))
    unknown += sorted(
        f"ROLE.{k}" for k in role_keys if not any(f"{r}.{k}" in actual for r in ROLES)
    )
    unknown += sorted(s for s in sections if not any(k.startswith(f"{s}.") for k in actual))
    assert unknown == [], f"README rows for keys values.yaml lacks: {unknown}"
