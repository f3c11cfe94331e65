"""An environment from a file, as a user writes one (named in a recipe as
`agent.environment: tests/environments_for_tests.py:TryAgain`)."""

import re

from rollout.episodes import Environment


class TryAgain(Environment):
    """Tells the model when its answer is wrong and lets it try again (up to agent.max_turns)."""

    def __init__(self, hint: str = "That is not right. Try again."):
        self.hint = hint

    def respond(self, row, messages):
        said = re.findall(r"-?\d+", messages[-1]["content"])
        if said and said[-1] == str(row["answer"]):
            return None  # right: the episode ends
        return [{"role": "user", "content": self.hint}]


class NotAnEnvironment:
    pass
