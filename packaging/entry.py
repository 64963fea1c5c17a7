"""Entry script of the PyInstaller executable: gevent's monkey patching, then the CLI.

``monkey.patch_all()`` must run before anything else imports socket, ssl, threading
or time, so it is the first statement, ahead of every activator import.
"""

from gevent import monkey

monkey.patch_all()

import sys

from activator.cli import main

if __name__ == "__main__":
    sys.exit(main())
