"""Benchmarks of activator against direct access and HAProxy: ``python -m bench [--quick]``.

See ``bench/__main__.py`` for the entry point and ``bench/RESULTS.md`` for the recorded run.
"""
