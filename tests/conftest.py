"""Shared fixtures: a real daemon in its own process, and clients for it."""

from __future__ import annotations

import os
import signal

import pytest

from kvstore.tools.harness.daemon_proc import ROOT, DaemonProc, start_daemon  # noqa: F401  (start_daemon: used by tests)


@pytest.fixture
def daemon(tmp_path):
    d = start_daemon(tmp_path)
    yield d
    if d.alive():
        assert d.stop() == 0
    d.cleanup()


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[DaemonProc] = []

    def make(*extra: str, **kw) -> DaemonProc:
        d = start_daemon(tmp_path, *extra, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        if d.alive():
            d.stop(signal.SIGTERM, timeout=30)  # kills it if it does not exit in time
        d.cleanup()


def pytest_collection_modifyitems(config, items):
    """Skip `gpu` tests without CUDA and `vllm` tests without vLLM, saying why."""
    import importlib.util

    have_vllm = importlib.util.find_spec("vllm") is not None
    have_cuda = False
    try:
        import torch

        have_cuda = torch.cuda.is_available()
    except ImportError:
        pass
    for item in items:
        if "vllm" in item.keywords and not have_vllm:
            item.add_marker(pytest.mark.skip(reason="vLLM is not installed (pip install -e .[vllm])"))
        if "gpu" in item.keywords and not have_cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA device on this machine"))


os.environ.setdefault("PYTHONPATH", str(ROOT))
