"""The old import path of gptopt.models.checkpoint, kept so that users' code goes on working:

    python -c "from gptopt.checkpoint import save_model, load_model"

gptopt's own modules import gptopt.models.checkpoint (tests/test_imports.py holds them to it).
"""

from gptopt.models.checkpoint import *  # noqa: F401,F403
