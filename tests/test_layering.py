"""The dependency direction of docs/design.md, checked on the source: every import that runs (at module
level or inside a function; `if TYPE_CHECKING:` blocks are types only and left out) points down.

Between packages: `tools -> server -> kvstore -> tiers, eviction`, `connectors -> kvstore, tiers`;
`tiers` and `eviction` import nothing of each other. The packages are `kvstore.tiers`, ... (the folders
linked from kvstore/): an import by the folder's own top-level name is wrong too, since a wheel has none.
Inside kvstore/, each module has a layer and imports only from lower ones; the client side (client.py,
transports.py) imports none of the store core. `kvstore/__main__.py` is the command's entry point.
"""

from __future__ import annotations

import ast
from pathlib import Path

from kvstore.tools.harness.daemon_proc import ROOT

LINKED = ("tiers", "eviction", "server", "connectors", "tools")  # kvstore/<name> -> ../<name>
PACKAGES = {  # package -> the project packages (or modules) it may import (besides itself)
    "tiers": {"kvstore.keys"},  # the store key's layout, for the tiers' records; it imports nothing of the project
    "eviction": set(),
    "kvstore": {"tiers", "eviction"},
    "server": {"kvstore", "tiers", "eviction"},
    "connectors": {"kvstore", "tiers"},
}
# kvstore/: a module imports only modules of a lower layer.
LAYERS = {
    "errors": 0, "keys": 0, "wire": 0,
    "tokens": 1, "protocol": 1, "config": 2,
    "block_events": 3, "compression": 3, "entry": 4, "index": 5, "placement": 6, "recovery_rows": 6,
    "codec_loops": 0, "codec_fast": 0, "codec": 1, "codec_profile": 2, "codec_triton": 2, "gpu_decode": 3,
    "sharing": 7, "waits": 7, "recovery": 7, "gpu_demoter": 7, "compaction": 7, "resting": 7, "background": 8,
    "promotion": 8, "store_check": 9, "clearing": 9, "store": 10, "chain": 11,
    "transports": 3, "client": 4,  # the client side
}
CLIENT_SIDE = {"client", "transports"}
BASE = {m for m, layer in LAYERS.items() if layer <= 2}  # what both sides may import


def runtime_imports(path: Path) -> list[str]:
    """The modules `path` imports outside `if TYPE_CHECKING:` blocks (relative imports resolved)."""
    folder = path.relative_to(ROOT).parts[0]
    return imports_of(path.read_text(), "kvstore" if folder == "kvstore" else f"kvstore.{folder}")


def package_of(name: str) -> str | None:
    """The project package a module name belongs to (None: not the project's)."""
    parts = name.split(".")
    if parts[0] != "kvstore":
        return None
    return parts[1] if len(parts) > 1 and parts[1] in LINKED else "kvstore"


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
    """The core module (kvstore/<module>.py) a name imports, if it is one."""
    parts = name.split(".")
    return parts[1] if package_of(name) == "kvstore" and len(parts) > 1 else None


def test_packages_import_only_downward():
    wrong = []
    for package, allowed in PACKAGES.items():
        for path in sorted((Path(ROOT) / package).glob("*.py")):
            if path.name == "__main__.py":  # the command's entry point, above every package
                continue
            for name in runtime_imports(path):
                dep = package_of(name)
                if name.split(".")[0] in LINKED + ("tests",):
                    wrong.append(f"{path.relative_to(ROOT)} imports {name} (not an installed name)")
                elif dep is not None and dep != package and dep not in allowed and name not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert wrong == []


def test_nothing_imports_a_folder_by_its_top_level_name():
    """tools/, tests/ and the packages alike: a wheel installs `kvstore` alone."""
    wrong = [f"{path.relative_to(ROOT)} imports {name}"
             for folder in (*PACKAGES, "tools", "tests") for path in sorted((Path(ROOT) / folder).rglob("*.py"))
             for name in runtime_imports(path) if name.split(".")[0] in LINKED]
    assert wrong == []


def test_kvstore_modules_import_only_lower_layers():
    paths = sorted((Path(ROOT) / "kvstore").glob("*.py"))
    assert {p.stem for p in paths} - {"__init__", "__main__"} == set(LAYERS), "every kvstore module needs a layer here"
    wrong = []
    for path in paths:
        me = path.stem
        if me in ("__init__", "__main__"):
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
    assert imports_of("from . import disk\nimport tiers.host\n", "kvstore.tiers") == ["kvstore.tiers.disk", "tiers.host"]
    assert package_of("kvstore.tiers.disk") == "tiers" and package_of("kvstore.store") == "kvstore"
    assert package_of("tiers.disk") is None
