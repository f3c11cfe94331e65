"""User-facing errors.

A `UserError` is a mistake in what the user gave us (a recipe key, a file, a data row). The CLI
prints its message on one line and exits with status 2, without a traceback; anything else is a bug
and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input; the message names the key, file or row."""

    exit_code = 2


class ClusterError(UserError):
    """The cluster failed the run (a trainer host died or never joined): one line naming the
    host, exit status 1. Running the same command again resumes from the last checkpoint."""

    exit_code = 1


class CheckpointError(UserError):
    """A checkpoint could not be written (disk full, permissions) or none could be read: one
    line naming the directory and step, exit status 1. What was saved before is left intact."""

    exit_code = 1


def warn(message: str) -> None:
    """A problem the run recovers from, on one line of stderr like the CLI's errors."""
    import sys

    print(f"posttrain: warning: {message}", file=sys.stderr, flush=True)
