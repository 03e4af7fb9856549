"""Benchmarks: prefix match (the lmdeploy anchor's workload) and one scheduler step."""
