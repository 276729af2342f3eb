"""gptopt: make GPT-2-class Transformers train, benchmark, profile, generate and serve fast."""

__version__ = "0.1.0"
