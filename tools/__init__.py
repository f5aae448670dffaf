"""The `kvstore` command line (serve, stats, replay, ...) and the benchmark scripts."""
