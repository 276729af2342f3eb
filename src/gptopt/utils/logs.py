"""gptopt's log lines: 'gptopt: MESSAGE' on stderr, INFO and up, for every command and serve's engine process.

    python -c "import logging, gptopt.utils.logs as g; g.setup_logging(); logging.getLogger('gptopt').info('hi')"
"""

from __future__ import annotations

import logging
import sys


class _StderrHandler(logging.Handler):
    """Writes to whatever sys.stderr is at the time (test runners and tqdm swap it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def setup_logging() -> None:
    """gptopt's log lines on stderr as 'gptopt: MESSAGE', INFO and up (the CLI, and serve's engine process)."""
    # Our logger only: configuring the root logger would print every library's INFO chatter too.
    logger = logging.getLogger("gptopt")
    if not logger.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("gptopt: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO)
