"""The project's benchmarks: ``python benchmarks/run.py`` (docs/benchmarks.md) and
``python -m benchmarks evaluate`` (docs/evaluation.md). Never imported by the library."""
