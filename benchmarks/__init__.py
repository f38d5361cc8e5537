"""The benchmarks, installed as ``unroll.benchmarks``: speed, quality, memory and soak measurements that write
``benchmarks/results/``.

They import the core (``unroll``), the stages (``unroll.export``, ``unroll.serving``) and the pipeline
(``unroll.pipeline``, which builds what a run needs), never the application layer ``unroll.app``
(``tests/test_architecture.py``).
"""
