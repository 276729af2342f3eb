"""gptopt bench: the measured optimisation ladders (ladder.py: training; infer.py: generation; quality.py: time to
a target loss), what they share (setup.py) and their reports (report.py); main.py picks by --mode.
"""
