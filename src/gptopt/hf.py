"""The old import path of gptopt.models.hf, kept so that users' code goes on working:

    python -c "from gptopt.hf import load_pretrained, export_hf"

gptopt's own modules import gptopt.models.hf (tests/test_imports.py holds them to it).
"""

from gptopt.models.hf import *  # noqa: F401,F403
