"""The evaluation: fault tolerance with ten restores, baselines, ablations and sweeps.

``python -m benchmarks evaluate`` trains three workloads on the CPU under every method and
writes docs/evaluation.md with its plots; ``--quick`` is the seconds-long smoke test.
"""
