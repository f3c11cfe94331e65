"""Tools for the multi-turn tests (named in specs as tests/tools_for_tests.py:NAME)."""

import time


def divide(a: float, b: float) -> str:
    """Divide one number by another.

    Args:
        a: the dividend
        b: the divisor
    """
    return str(a / b)  # ZeroDivisionError on b == 0: the model reads an error message


def wait(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: how long
    """
    time.sleep(seconds)  # a tool that hangs (past the per-call timeout)
    return "done"


def exit_process() -> str:
    """End the worker process that runs the tool."""
    import os

    os._exit(3)


def lookup(key: str, table: dict) -> str:
    """Look a key up.

    Args:
        key: what to look up
        table: the table (bound by the recipe: the model never sees it)
    """
    return str(table.get(key, "not found"))
