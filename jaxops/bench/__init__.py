"""Benchmarks: ``python -m jaxops.bench <family> [options]``.

Each family is a module of this package with a ``main(argv)``; the command
imports the module named on the command line, so adding a family adds a file.
"""
