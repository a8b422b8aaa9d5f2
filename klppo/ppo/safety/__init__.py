"""What keeps a run safe beside the loss: the KL guard (`kl_guard.py`), the checks that decide each optimizer step
(`step_checks.py`), non-finite values across updates (`nonfinite.py`), the copy that undoes an update
(`rollback.py`), and the PPO health monitor (`health.py`)."""
