"""The dependency direction of docs/design.md, checked on the source: every import that runs (at module
level or inside a function; `if TYPE_CHECKING:` blocks are types only and left out) points down.

Between packages: `tools -> server -> kvstore -> tiers, eviction`, `connectors -> kvstore, tiers`;
`tiers` and `eviction` import nothing of each other. Inside kvstore/, each module has a layer and
imports only from lower ones; the client side (client.py, transports.py) imports none of the store core.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tools.harness.daemon_proc import ROOT

PACKAGES = {  # package -> the project packages it may import (besides itself)
    "tiers": set(),
    "eviction": set(),
    "kvstore": {"tiers", "eviction"},
    "server": {"kvstore", "tiers", "eviction"},
    "connectors": {"kvstore", "tiers"},
}
# kvstore/: a module imports only modules of a lower layer.
LAYERS = {
    "errors": 0, "keys": 0, "wire": 0,
    "tokens": 1, "protocol": 1, "config": 2,
    "block_events": 3, "entry": 4, "index": 5, "placement": 6,
    "sharing": 7, "waits": 7, "recovery": 7, "gpu_demoter": 7,
    "promotion": 8, "store_check": 9, "store": 10, "chain": 11,
    "transports": 3, "client": 4,  # the client side
}
CLIENT_SIDE = {"client", "transports"}
BASE = {m for m, layer in LAYERS.items() if layer <= 2}  # what both sides may import


def runtime_imports(path: Path) -> list[str]:
    """The modules `path` imports outside `if TYPE_CHECKING:` blocks (relative imports resolved)."""
    return imports_of(path.read_text(), ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1]))


def imports_of(source: str, package: str) -> list[str]:
    """The modules `source` (a module of `package`) imports outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(source)
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            found.extend([base] if node.module else [f"{base}.{alias.name}" for alias in node.names])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def kvstore_module(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if parts[0] == "kvstore" and len(parts) > 1 else None


def test_packages_import_only_downward():
    wrong = []
    for package, allowed in PACKAGES.items():
        for path in sorted((Path(ROOT) / package).glob("*.py")):
            for name in runtime_imports(path):
                top = name.split(".")[0]
                if top in PACKAGES.keys() | {"tools", "tests"} and top != package and top not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_kvstore_modules_import_only_lower_layers():
    paths = sorted((Path(ROOT) / "kvstore").glob("*.py"))
    assert {p.stem for p in paths} - {"__init__"} == set(LAYERS), "every kvstore module needs a layer here"
    wrong = []
    for path in paths:
        me = path.stem
        if me == "__init__":
            continue
        for name in runtime_imports(path):
            dep = kvstore_module(name)
            if dep is None or dep == me:
                continue
            if LAYERS.get(dep, 99) >= LAYERS[me]:
                wrong.append(f"kvstore/{me}.py (layer {LAYERS[me]}) imports kvstore.{dep} (layer {LAYERS.get(dep)})")
            elif (me in CLIENT_SIDE) != (dep in CLIENT_SIDE) and dep not in BASE:
                wrong.append(f"kvstore/{me}.py imports kvstore.{dep} across the client/store line")
    assert wrong == []


def test_the_check_sees_imports_inside_functions_and_skips_type_only_ones():
    """The negative control: a function-level import is found, a TYPE_CHECKING one is not."""
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvstore.store import TieredStore\n"
              "def f():\n    from kvstore.placement import Placement\n    from . import index\n")
    assert imports_of(source, "kvstore") == ["typing", "kvstore.placement", "kvstore.index"]
