"""The daemon: data-plane RPC (Unix socket + TCP), admin HTTP (aiohttp), metrics."""
