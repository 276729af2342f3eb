"""Training: THE step (step.py) that train, bench, tune and profile run, the optimizers, wrapping for devices
and compile, the loop (loop.py) and what it records, resuming, and the step's memory plan.
"""
