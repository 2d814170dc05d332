"""The training loop and what it needs: processes, mesh, schedule, checkpoints, metrics."""
