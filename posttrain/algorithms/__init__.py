"""Algorithms: each module reads top to bottom and states its math in its docstring."""
