"""gptopt bench: the measured optimisation ladder (ladder.py) and its reports (report.py)."""
