"""What spans a run's updates: the state one update leaves for the next (`state.py`), checkpoints (`checkpoint.py`),
reference resets (`reference_resets.py`), one run per output_dir (`lock.py`), stop signals (`preemption.py`), and the
callbacks around the loop: progress bar, wandb, phase timings (`callbacks.py`)."""
