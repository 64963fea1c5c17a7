"""The pure core: every decision that matters, with no I/O and no yielding.

Nothing under ``activator.core`` may import gevent, falcon, yaml or socket
(``tests/core/test_purity.py`` checks it). Time is always passed in as ``now``
(seconds, monotonic). Code here never blocks, so under gevent each call runs
atomically: the shell needs no locks around it.
"""
