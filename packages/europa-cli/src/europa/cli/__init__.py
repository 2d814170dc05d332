"""The ``europa`` command line."""
