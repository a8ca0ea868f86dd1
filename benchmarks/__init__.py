"""Speed and memory benchmarks (not part of the tests' pass/fail): ``python -m benchmarks NAME [--json PATH]``.

``harness`` holds what every benchmark shares (rotated round-robin timing, median/IQR, within-round ratios, peak
memory, the machine's load, the JSON record); ``workloads`` the models; one module per benchmark (``step``,
``paper_mlp``, ``conv2d``, ``evaluation``, ``damping_sweep``); ``report`` turns ``results/*.json`` into the tables of
``benchmarks/README.md`` and the book.
"""
