"""Training: THE step (step.py) that train, bench, tune and profile run, the optimizers, wrapping for devices
and compile, and the run around the step, a room a role: the loop (loop.py), the run's folder and its checkpoints
(checkpointing.py), --auto_batch_size's search (auto_batch.py), evaluation (validation.py), run.json and the summary
(run_record.py), metrics, resuming, and the step's memory plan.
"""
