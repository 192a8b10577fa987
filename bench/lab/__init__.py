"""Lab benchmarks: one layer each, measured in process (or one concern, such as tracing's cost, across
servers it starts), each backing a figure in docs/benchmarks.md.

They are not what a user runs against a deployment (that is ``pdserve bench`` and the chaos soak,
``python -m bench.chaos``); each measures one part of the engine, the transfer, the router or the
planner on this machine. Run one with ``python -m bench.lab.NAME --help``.
"""
