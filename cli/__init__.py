"""Entry points and their configuration.

The ``pdserve`` command line (flags, ``--config`` YAML files, ``generate``, ``plan``,
``bench``) and the Ray Serve application (``cli.serve_app:build_app``), whose args are
validated by the same parser. Nothing below imports this package.
"""
