"""Each side of the cluster moves its requests' ledger records through one object: the
router's ``RouterTransitions``, the workers' ``PrefillTransitions`` and
``DecodeTransitions``; block holdings and worker records through its ``Membership``.
import-linter cannot say which module calls which method, so this test reads the sources:
every call of a ledger write outside those files fails it, naming the file and line."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVING_SIDE = ("router", "prefill_worker", "decode_worker", "serving", "kv_transfer", "ledger")

# The Ledger's methods that write, by what they write.
RECORD_WRITES = {"create_request", "transition"}
HOLDING_WRITES = {
    "restore_decoding",  # a record with its holding, rebuilt after Redis lost it
    "claim_blocks",
    "resize_blocks",
    "free_blocks",
    "renew_lease",
    "reap_expired",
    "register_worker",
    "heartbeat",
    "deregister_worker",
    "join_generation",
}
TRANSITIONS = (
    "router/transitions.py",
    "prefill_worker/transitions.py",
    "decode_worker/transitions.py",
)
ALLOWED = {
    **{name: set(TRANSITIONS) for name in RECORD_WRITES},
    **{name: {"ledger/membership.py"} for name in HOLDING_WRITES},
    "reap_expired": {"router/transitions.py"},  # the router's reaper
}
DEFINED_IN = "ledger/ledger.py"  # the Ledger itself


def ledger_writes(path: Path) -> list[tuple[str, int]]:
    """(method, line) of every call of a ledger write in the file at ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        (node.func.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ALLOWED
    ]


def test_ledger_writes_go_through_each_sides_owner_objects() -> None:
    misplaced = []
    for package in SERVING_SIDE:
        for path in sorted((REPO / package).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            if name == DEFINED_IN:
                continue
            misplaced += [
                f"{name}:{line}: {method}"
                for method, line in ledger_writes(path)
                if name not in ALLOWED[method]
            ]
    assert misplaced == [], "ledger writes outside the owner objects: " + ", ".join(misplaced)


def test_every_side_has_its_transitions() -> None:
    """The owner files exist and write: the allow-list above names no file that is gone."""
    for name in TRANSITIONS:
        methods = {method for method, _ in ledger_writes(REPO / name)}
        assert "transition" in methods, name
    membership = {method for method, _ in ledger_writes(REPO / "ledger/membership.py")}
    assert membership >= HOLDING_WRITES - {"reap_expired"}
