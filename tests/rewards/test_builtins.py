"""Built-in rewards on hand-picked cases (the code sandbox itself: test_sandbox.py)."""

import pytest

from rewards.builtins import (code_reward, exact_match_reward, extract_answer, format_reward,
                              length_reward, math_reward)


@pytest.mark.parametrize("completion,truth,want", [
    (r"so \boxed{1/2}", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{1}{2}}", "1/2", 1.0),
    (r"\boxed{\frac{2}{4}}", "0.5", 1.0),
    (r"the length is \boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{5 \mathrm{m}}", "5", 1.0),
    (r"\boxed{3}", "4", 0.0),
    (r"\boxed{0.49}", "1/2", 0.0),
    ("no final answer here", "1", 0.0),
])
def test_math_equivalences(completion, truth, want):
    assert math_reward(["q"], [completion], answer=[truth]) == [want]


def test_math_answer_tag_and_chat_completions():
    assert math_reward(["q"], ["<answer>12</answer>"], answer=["12"], answer_tag="answer") == [1.0]
    chat = [[{"role": "assistant", "content": r"\boxed{7}"}]]
    assert math_reward(["q"], chat, answer=["7"]) == [1.0]


def test_extract_answer_nested_braces():
    assert extract_answer(r"\boxed{\frac{1}{2}} then \boxed{\sqrt{2}}") == r"\sqrt{2}"


def test_format_with_and_without_tags():
    good = "<think>add them</think>\n<answer>5</answer>"
    assert format_reward(None, [good, "5", "<think>x</think>", "<answer>5</answer>",
                                "<think>a</think><answer></answer>",
                                "<think>a<think>b</think></think><answer>5</answer>"]) == \
        [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert format_reward(None, ["The answer is 42.", "42"], pattern=r"answer is \d+") == [1.0, 0.0]


def test_exact_match():
    assert exact_match_reward(None, [" Paris ", "paris", r"\boxed{Paris}"], answer=["Paris"] * 3) == \
        [1.0, 0.0, 1.0]


def test_length_soft_overlong_penalty():
    ids = [[0] * n for n in (10, 12, 14, 16, 20)]
    # max 16, buffer 4: no penalty up to 12, linear to -1 at 16, -1 beyond
    assert length_reward(None, [""] * 5, completion_ids=ids, max_tokens=16, buffer_tokens=4) == \
        [0.0, 0.0, -0.5, -1.0, -1.0]


# ---- code --------------------------------------------------------------------------
ADD = "```python\ndef add(a, b):\n    return a + b\n```"


def test_code_passes_and_fails():
    tests = [["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]] * 2
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    assert code_reward(None, [ADD, wrong], tests=tests) == [1.0, 0.0]
    io = [[{"input": "3\n", "output": "6"}, {"input": "5\n", "output": "10"}]]
    assert code_reward(None, ["print(int(input()) * 2)"], tests=io) == [1.0]
