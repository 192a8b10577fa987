"""What users run against a server: the load generator of ``pdserve bench``, the chaos soak
(``python -m bench.chaos``) and the serving comparisons that rewrite their sections of docs/benchmarks.md;
``bench.lab``: benchmarks of one layer each (docs/load_testing.md)."""

import os

# Weights and KV through 2 MB pages, as in the serving workers (``cluster/workers.py``): torch reads
# the switch once, at its first allocation, so it is set here, before any bench module imports torch.
# An explicit value (``THP_MEM_ALLOC_ENABLE=0``) wins.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
