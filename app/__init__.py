"""The application layer, installed as ``unroll.app``: the ``unroll`` CLI, ``unroll serve``, the doctor and the
container staging. It sits above every stage (``unroll.export``, ``unroll.serving``, ``unroll.benchmarks``) and the
pipeline, and nothing below imports it (``tests/test_architecture.py``)."""
