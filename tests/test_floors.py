"""The package's floors (docs/architecture.md): which package may import which.

Read from the source's own import statements (relative ones resolved), not by importing
it: an arrow drawn once in a function body counts as much as one at the top."""

from __future__ import annotations

import ast
from pathlib import Path

from ttft_relay.testing.harness import REPO

PACKAGE = "ttft_relay"

STILL_TWO_WAY: set[frozenset[str]] = set()
"""Package pairs that still import each other: none any more, and nothing may join them."""

GROUND = ("apis", "text", "flows", "chunked", "config", "listeners", "store", "prefork")
"""What imports nothing of the relay's (but itself)."""

ASKS_THE_REGISTRY = {
    "ttft_relay.scope",  # resolves each request's Api, once
    "ttft_relay.guard.refusals",  # a refusal's error format before scope ran
    "ttft_relay.guard.keys",  # where keys travel
    "ttft_relay.stream.sseview",  # flows scope never saw (out of scope, loaded from a file)
    "ttft_relay.patches.speed.upstream_pool",  # where keys travel: connections are not shared across keys
    "ttft_relay.diagnose.cli", "ttft_relay.diagnose.probe", "ttft_relay.diagnose.probe_requests",
}
"""The modules outside apis/ that import the registry (`ttft_relay.apis` itself, not one of its
modules): everyone else takes the flow's Api from its state."""


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path = REPO) -> dict[str, set[str]]:
    """Each module of the package → the modules of the package it imports; `from a import b`
    names `a.b` when b is a module or package of the tree, else `a`."""
    found: dict[str, set[str]] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        name = module_name(path, root)
        if name.startswith(f"{PACKAGE}.testing"):
            continue
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = found.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                if module.split(".")[0] != PACKAGE:
                    continue
                for alias in node.names:
                    sub = root.joinpath(*module.split("."), alias.name)
                    is_module = sub.is_dir() or sub.with_suffix(".py").is_file()
                    targets.add(f"{module}.{alias.name}" if is_module else module)
    return found


def floor(module: str) -> str:
    """The package (or top-level module) of the package that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def two_way(found: dict[str, set[str]]) -> set[frozenset[str]]:
    arrows = {(floor(a), floor(b)) for a, targets in found.items() for b in targets if floor(a) != floor(b)}
    return {frozenset(arrow) for arrow in arrows if arrow[::-1] in arrows}


def test_no_new_two_way_imports_between_packages():
    # Before the Api moved onto FlowState: stream<->apis, trim<->apis, stream<->timing,
    # guard<->timing and patches<->timing imported each other.
    assert two_way(imports()) <= STILL_TWO_WAY


def test_the_ground_floor_imports_nothing_of_the_relays():
    for name, targets in imports().items():
        if floor(name) in GROUND:
            assert {floor(t) for t in targets} <= {floor(name)}, (name, targets)


def test_the_registry_is_asked_only_where_an_api_is_chosen():
    asking = {name for name, targets in imports().items() if f"{PACKAGE}.apis" in targets and floor(name) != "apis"}
    assert asking <= ASKS_THE_REGISTRY, asking - ASKS_THE_REGISTRY
