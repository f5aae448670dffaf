"""Imported by the engines' fork server (tools/harness/engine_fork.py): vLLM, imported once for all engines."""

from kvstore.tools.harness.engine_fork import preload

preload()
