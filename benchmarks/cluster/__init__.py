"""Benchmarks over several Ray nodes on this host: network namespaces joined by shaped veth links."""
