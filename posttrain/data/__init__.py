"""Data: tokenizers and chat templates, SFT/RL datasets, the generated task, packing."""
