"""Options, presets and their checks: keyword-only dataclasses, the single source of truth of every option."""

from gptopt.config.train import *  # noqa: F401,F403
