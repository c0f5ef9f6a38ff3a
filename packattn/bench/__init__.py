"""Benchmarks: the workloads of workloads.md, the anchors, and the runner behind `packattn bench`."""
