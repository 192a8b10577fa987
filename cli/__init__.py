"""The ``pdserve`` command line and its configuration: flags, YAML files, Ray Serve args."""
