"""Finding the `tandem` command's plugins: entry points that installed distributions
declare. A name two plugins claim is an error, never a silent choice: which one won
would depend on the order in which distributions happen to be found."""

from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import EntryPoint, entry_points

COMMANDS_GROUP = "tandem.commands"  # one subcommand each: register(subparsers)
IN_PROCESS_GENERATE_GROUP = "tandem.generate.in_process"  # the engine of `tandem generate`
LOCAL_MODELS_GROUP = "tandem.models.local"  # `tandem models` without a router


class PluginConflict(Exception):
    """Two installed plugins claim one name."""

    def __init__(self, group: str, what: str, claims: list[EntryPoint]) -> None:
        listed = " and ".join(_describe(ep) for ep in claims)
        super().__init__(
            f"{len(claims)} installed plugins claim {what} (entry point group {group!r}): "
            f"{listed}; uninstall one of those distributions, or install versions that agree"
        )
        self.group = group
        self.claims = claims


def _describe(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    where = f" from {dist.name} {dist.version}" if dist is not None else ""
    return f"{ep.name} = {ep.value}{where}"


def by_name(group: str, found: Iterable[EntryPoint] | None = None) -> list[EntryPoint]:
    """The entry points of ``group`` (or ``found``), one per name, sorted by name;
    PluginConflict where two with different targets share a name (the same target seen
    twice, as an editable install and its metadata both on the path, is one plugin)."""
    if found is None:
        found = entry_points(group=group)
    claims: dict[str, list[EntryPoint]] = {}
    for ep in found:
        same_name = claims.setdefault(ep.name, [])
        if all(ep.value != other.value for other in same_name):
            same_name.append(ep)
    for name, eps in claims.items():
        if len(eps) > 1:
            raise PluginConflict(group, f"the name {name!r}", eps)
    return [claims[name][0] for name in sorted(claims)]


def the_one(group: str, what: str) -> EntryPoint | None:
    """The single entry point of ``group``, which provides ``what`` (whatever its name),
    None without any; PluginConflict for two."""
    found = by_name(group)
    if len(found) > 1:
        raise PluginConflict(group, what, found)
    return found[0] if found else None
