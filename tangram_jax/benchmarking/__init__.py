"""What every benchmark shares: one timing helper (`timing`), one workload module (`workload`:
SCBench-shaped sessions, Poisson arrivals, the skewed budget profile), one result writer with
provenance (`results`), the random 8B-shaped model (`models`) and the serving harness behind
`tangram-jax bench serve` (`serve`, with `vllm_driver` for vLLM beside it).

The scripts in the checkout's `benchmarks/` import from here (the package is installed), so no
script patches `sys.path`.
"""
