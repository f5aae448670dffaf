"""What the tests and the benchmarks share, so that neither imports the other: a daemon in its own
process (`daemon_proc`), vLLM engines in subprocesses (`vllm_helpers`, `engine_runner`), a Mooncake
master and two hosts in network namespaces (`remote_env`), and stand-ins for the vLLM objects the
connector's sides read (`connector_standins`)."""
