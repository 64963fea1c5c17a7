"""Benchmarks of activator against direct access and HAProxy: ``python -m bench [--quick]``.

See ``bench/__main__.py`` for the entry point and ``bench/RESULTS.md`` for the recorded run.
The processes, ports and waits are the test harness's (``tests/harness.py``, imported as
``harness``): importing this package adds ``tests/`` to ``sys.path``, as
``tests/conftest.py`` does for the tests (at the end: nothing of the bench's is shadowed).
"""

import os
import sys

_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
