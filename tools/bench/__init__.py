"""Benchmarks and studies: scripts that measure, apart from the `kvstore` CLI commands in tools/."""
