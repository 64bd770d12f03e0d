"""The project's benchmarks: ``python -m benchmarks run`` (docs/benchmarks.md) and
``python -m benchmarks evaluate`` (docs/evaluation.md). Never imported by the library."""
