"""The serving stage, installed as ``unroll.serving``: the Triton model repository, the tritonserver process and
its supervisor, the CPU runtimes of the Python backend, and the REST gateway (``unroll.serving.gateway``).

A stage: it imports the core (``unroll``: card, tasks, artifacts, errors) and nothing of ``unroll.export``,
``unroll.pipeline``, ``unroll.benchmarks`` or ``unroll.app`` (``tests/test_architecture.py``); what the gateway and
``unroll serve`` import runs in the serving image, which has no PyTorch.
"""
