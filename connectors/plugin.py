"""The vLLM plugin: registers the connector's name with vLLM's connector factory.

vLLM calls every `vllm.general_plugins` entry point (pyproject.toml) in each process it starts, before
it reads `--kv-transfer-config`, so `{"kv_connector": "KVStoreConnector", "kv_role": "kv_both"}` finds
the connector with no `kv_connector_module_path`. The module-path form keeps working beside it.

Registration is lazy (vLLM imports `kvstore.connectors.vllm` only when an engine creates the connector),
idempotent (a second call, or a name registered by someone else first, changes nothing) and imports no
CUDA module: a CPU host loads it like any other.
"""

from __future__ import annotations

CONNECTOR_NAME = "KVStoreConnector"
CONNECTOR_MODULE = "kvstore.connectors.vllm"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, "KVStoreConnector")
    except ValueError:  # registered already: by an earlier call in this process
        pass
