"""The tools wing: the `hsoffload` command (`cli`), the demo, the benchmarks (`bench`) and their workloads."""
