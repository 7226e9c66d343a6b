"""Developer microbenchmarks (kernels per shape, A/B against another source): run from the repository root,
`python -m benchmarks.attention`, `python -m benchmarks.quant_kernels`. What users run lives in pagoda/bench."""
