"""Built-in rewards on hand-picked cases, and the code sandbox's containment."""

import os
from pathlib import Path

import pytest

from rewards.builtins import (code_reward, exact_match_reward, extract_answer, format_reward,
                              length_reward, math_reward)
from rewards.sandbox import run_tests


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


# ---- the sandbox --------------------------------------------------------------------------
ADD = "```python\ndef add(a, b):\n    return a + b\n```"


def test_code_passes_and_fails():
    tests = [["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]] * 2
    wrong = "```python\ndef add(a, b):\n    return a - b\n```"
    assert code_reward(None, [ADD, wrong], tests=tests) == [1.0, 0.0]
    io = [[{"input": "3\n", "output": "6"}, {"input": "5\n", "output": "10"}]]
    assert code_reward(None, ["print(int(input()) * 2)"], tests=io) == [1.0]


def test_code_timeout_is_contained():
    r = run_tests("while True:\n    pass", ["assert True"], timeout_s=1)
    assert r.status == "timeout" and r.fraction_passed == 0.0


def test_write_outside_directory_is_refused(tmp_path):
    target = tmp_path / "escaped.txt"
    r = run_tests(f"open({str(target)!r}, 'w').write('x')", ["assert True"])
    assert r.fraction_passed == 0.0 and not target.exists()
    assert "outside the working directory" in r.errors[0]
    # inside its own directory is fine, and the directory is removed afterwards
    r = run_tests("import os\nopen('ok.txt', 'w').write('x')\nWD = os.getcwd()",
                  ["assert open('ok.txt').read() == 'x'"])
    assert r.fraction_passed == 1.0
    assert not list(Path("/tmp").glob("posttrain-sandbox-*"))


def test_network_is_refused():
    r = run_tests("import socket\ns = socket.socket()\ns.connect(('127.0.0.1', 22))", ["assert True"])
    assert r.fraction_passed == 0.0


def test_fork_bomb_is_contained():
    before = len(os.listdir("/proc"))
    r = run_tests("import os\nwhile True:\n    os.fork()", ["assert True"], timeout_s=2)
    assert r.fraction_passed == 0.0
    assert len(os.listdir("/proc")) < before + 5  # no stray processes left behind


def test_memory_limit_is_contained():
    r = run_tests("x = bytearray(4 * 1024**3)", ["assert True"], memory_mb=256)
    assert r.fraction_passed == 0.0 and "MemoryError" in " ".join(r.errors)


def test_no_access_to_parent_secrets(monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "secret-value")
    r = run_tests("import os\nKEY = os.environ.get('WANDB_API_KEY')", ["assert KEY is None"])
    assert r.fraction_passed == 1.0


def test_process_exit_in_user_code_is_scored():
    r = run_tests("import os\nos._exit(0)", ["assert True"])
    assert r.status == "crashed" and r.fraction_passed == 0.0
