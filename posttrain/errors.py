"""User-facing errors.

A `UserError` is a mistake in what the user gave us (a recipe key, a file, a data row). The CLI
prints its message on one line and exits with status 2, without a traceback; anything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input; the message names the key, file or row."""

    exit_code = 2
