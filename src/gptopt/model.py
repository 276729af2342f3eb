"""The old import path of gptopt.models.gpt, kept so that users' code goes on working:

    python -c "from gptopt.model import GPT, GPTConfig"

gptopt's own modules import gptopt.models.gpt (tests/test_imports.py holds them to it).
"""

from gptopt.models.gpt import *  # noqa: F401,F403
