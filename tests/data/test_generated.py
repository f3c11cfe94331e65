"""The generated arithmetic task: the held-out split, and worked answers whose every step is right."""

import re

import pytest

from posttrain.data import generated
from posttrain.data.generated import Problem

STEP = re.compile(r"^(\d+) ([+-]) (\d+)(?: \2 (\d))? = (-?\d+)$")


def check_steps(p: Problem, text: str) -> None:
    """Each 'x op y [op carry] = z' is true arithmetic, the first column has no carry and later
    ones carry exactly what the previous column produced; the final number is the answer."""
    work, final = text.rsplit(", so ", 1)
    assert final == f"{p.answer}. The answer is {p.answer}."
    if p.op == "-" and p.a < p.b:
        head, work = work.split(": ", 1)
        assert head == f"{p.a} < {p.b}, so -({p.b} - {p.a})"
        x, y = p.b, p.a
    else:
        x, y = p.a, p.b
    carry, digits = 0, []
    for i, step in enumerate(work.split(", ")):
        m = STEP.match(step)
        assert m, step
        lhs, op, rhs, c, z = int(m[1]), m[2], int(m[3]), m[4], int(m[5])
        assert (c is None) == (i == 0), step
        assert int(c or 0) == carry, step
        assert op == p.op
        assert z == (lhs + rhs + carry if op == "+" else lhs - rhs - carry), step
        assert lhs % 10 == x // 10 ** i % 10 and rhs == y // 10 ** i % 10, step
        if op == "+":
            carry = z // 10 if i < len(str(max(x, y))) - 1 else 0
            digits.append(z if i == len(str(max(x, y))) - 1 else z % 10)
        else:
            assert 0 <= z <= 9 and lhs in (x // 10 ** i % 10, 10 + x // 10 ** i % 10), step
            carry = int(lhs >= 10)
            digits.append(z)
    value = sum(d * 10 ** i for i, d in enumerate(digits[:-1])) + digits[-1] * 10 ** (len(digits) - 1)
    assert value == abs(p.answer), (text, value)


def test_worked_answers_are_right_step_by_step():
    for p in generated.all_problems(99) + [Problem(100, 1, "-"), Problem(999, 1, "+"),
                                           Problem(5, 123, "-")]:
        check_steps(p, p.reply(worked=True))


def test_examples_read_as_on_paper():
    assert Problem(23, 18, "+").reply(True) == "3 + 8 = 11, 2 + 1 + 1 = 4, so 41. The answer is 41."
    assert Problem(23, 18, "-").reply(True) == "13 - 8 = 5, 2 - 1 - 1 = 0, so 5. The answer is 5."
    assert Problem(18, 23, "-").reply(True) == (
        "18 < 23, so -(23 - 18): 13 - 8 = 5, 2 - 1 - 1 = 0, so -5. The answer is -5.")
    assert Problem(7, 3, "+").reply() == "The answer is 10."


@pytest.mark.parametrize("fmt", ["text", "messages", "prompt_completion"])
def test_worked_share_and_true_answer_column(fmt):
    rows = generated.rows(fmt, "train", 2000, 30, 0, 0.15, worked=0.3)
    texts = [r.get("text") or r.get("completion") or r["messages"][1]["content"] for r in rows]
    share = sum(", so " in t for t in texts) / len(texts)
    assert 0.25 < share < 0.35  # 2000 Bernoulli(0.3) draws: 5 standard deviations is 0.05
    for r, t in zip(rows, texts):  # text rows carry no answer column; their answer ends the text
        assert t.endswith(f"The answer is {r.get('answer', t.rsplit(' ', 1)[-1][:-1])}.")
    assert generated.rows(fmt, "train", 50, 30, 0, 0.15) == generated.rows(fmt, "train", 50, 30, 0, 0.15, 0.0)
    assert not any(", so " in (r.get("text") or r.get("completion") or r["messages"][1]["content"])
                   for r in generated.rows(fmt, "train", 200, 30, 0, 0.15))


def test_held_out_problems_never_appear_in_training_rows():
    held = {(p.a, p.op, p.b) for p in generated.problems("eval", 10_000, 30, 0, 0.15)}
    train = {(p.a, p.op, p.b) for p in generated.problems("train", 30_000, 30, 0, 0.15)}
    assert held and train and not held & train
