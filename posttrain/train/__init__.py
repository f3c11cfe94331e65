"""Training: the jitted step, optimizer, checkpoints, the in-process loop and the Ray trainer group."""
