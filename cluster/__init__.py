"""Cluster bootstrap and the ``pdserve`` command line."""
