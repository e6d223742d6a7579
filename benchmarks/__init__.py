"""The benchmarks, run from the repository root as ``python -m benchmarks.<name>``; every
step benchmark goes through ``benchmarks.harness`` (see benchmarks/README.md)."""
