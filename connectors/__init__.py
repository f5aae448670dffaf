"""Engine adapters. Only this package imports inference engines (vLLM); see connectors/vllm.py."""
