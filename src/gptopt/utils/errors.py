"""UserError: a problem with what the user gave (an option, a file, a folder), said in one line with its fix.

    python -c "from gptopt.utils.errors import UserError; print(issubclass(UserError, ValueError))"

The command line prints a UserError as one line and exits 2; any other exception is a fault of gptopt's (or of a
library under it) and keeps its traceback, so that it can be reported and fixed. A ValueError still, so every
caller that catches ValueError catches it.
"""


class UserError(ValueError):
    """What the user gave is wrong or cannot work here; the message names the problem and the fix."""
