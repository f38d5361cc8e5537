"""The pipeline layer, installed as ``unroll.pipeline``: which artifacts each stage makes, whether they are up to
date, and running the stages that are not. It imports the stages (``unroll.export``, ``unroll.serving``) and the
core; the application layer (``unroll.app``) and the benchmarks ask it what is missing instead of calling each
other (``tests/test_architecture.py``)."""
