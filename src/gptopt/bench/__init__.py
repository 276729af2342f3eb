"""gptopt bench: the measured optimisation ladders (ladder.py: training; infer_ladder.py: generation, its rungs in
infer_rungs.py; quality.py: time to a target loss), what they share (setup.py) and their reports (report.py); main.py
picks by --mode.
"""
