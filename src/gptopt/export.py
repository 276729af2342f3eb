"""The old import path of gptopt.commands.export, kept so that users' code goes on working:

    python -c "from gptopt.export import OrtDecoder; help(OrtDecoder)"

gptopt's own modules import gptopt.commands.export (tests/test_imports.py holds them to it).
"""

from gptopt.commands.export import *  # noqa: F401,F403
