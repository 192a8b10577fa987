"""Sizing the P:D split: worker profiles, a discrete-event simulator of the cluster, and searches over it.

``profile`` (the versioned profile file) and ``sizing`` (``recommend``) are the live planner's
contract; ``profiler`` measures a profile (it loads the engine); ``simulator``, ``sim_workers``,
``results``, ``search``, ``workload`` and ``arrivals`` are the simulation.
"""
