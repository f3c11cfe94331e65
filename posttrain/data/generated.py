"""Arithmetic problems the code generates, so that every CPU recipe runs without a download.

Problems are `a + b` and `a - b` over 0..max_operand. The train/eval split is by a hash of the
problem itself, so a held-out problem never appears in training data in any format (pretraining
text, SFT chats or RL prompts).

An answer is written either straight ("The answer is 41.") or, for a share `worked` of the rows,
worked out column by column first, as a person does on paper:

    3 + 8 = 11, 2 + 1 + 1 = 4, so 41. The answer is 41.         (23 + 18: units, then tens + carry)
    13 - 8 = 5, 2 - 1 - 1 = 0, so 5. The answer is 5.           (23 - 18: borrow from the tens)
    18 < 23, so -(23 - 18): 13 - 8 = 5, 2 - 1 - 1 = 0, so -5. The answer is -5.

Each step is a one-digit fact next to the digits it uses, which a tiny model learns far more
easily than the whole sum in one token. The quickstart pretrains on both forms and SFTs on the
straight one (as most question/answer data is written); RL with a verifier then finds that working
the sum out gets it right more often.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    op: str

    @property
    def question(self) -> str:
        return f"What is {self.a} {self.op} {self.b}?"

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]

    def worked(self) -> str:
        """The column-by-column working that ends in the answer (see the module docstring)."""
        if self.op == "-" and self.a < self.b:
            return f"{self.a} < {self.b}, so -({self.b} - {self.a}): {_columns(self.b, self.a, '-')}, so {self.answer}"
        return f"{_columns(self.a, self.b, self.op)}, so {self.answer}"

    def reply(self, worked: bool = False) -> str:
        """The assistant's answer, straight or worked."""
        return f"{self.worked()}. The answer is {self.answer}." if worked else f"The answer is {self.answer}."

    def text(self, worked: bool = False) -> str:
        return f"{self.question} {self.reply(worked)}"


def _columns(a: int, b: int, op: str) -> str:
    """'3 + 8 = 11, 2 + 1 + 1 = 4' for 23 + 18; '13 - 8 = 5, 2 - 1 - 1 = 0' for 23 - 18 (a >= b
    for '-'). Units first; from the second column on, the carry (or borrow) is written even when 0."""
    xs, ys = str(a)[::-1], str(b)[::-1]
    steps, carry = [], 0
    for i in range(max(len(xs), len(ys))):
        x, y = int(xs[i]) if i < len(xs) else 0, int(ys[i]) if i < len(ys) else 0
        extra = f" {op} {carry}" if i else ""
        if op == "+":
            total = x + y + carry
            steps.append(f"{x} + {y}{extra} = {total}")
            carry = total // 10
        else:
            borrow = int(x - carry < y)
            steps.append(f"{'1' if borrow else ''}{x} - {y}{extra} = {10 * borrow + x - y - carry}")
            carry = borrow
    return ", ".join(steps)


def is_held_out(p: Problem, eval_fraction: float = 0.1) -> bool:
    h = hashlib.sha256(f"{p.a}{p.op}{p.b}".encode()).digest()
    return int.from_bytes(h[:4], "little") / 2**32 < eval_fraction


def all_problems(max_operand: int, kind: str = "arithmetic") -> list[Problem]:
    if kind == "calculator":  # two-digit products: beyond a tiny model's head, easy for a tool
        lo = min(10, max_operand)
        return [Problem(a, b, "*") for a in range(lo, max_operand + 1) for b in range(lo, max_operand + 1)]
    return [Problem(a, b, op) for a in range(max_operand + 1) for b in range(max_operand + 1)
            for op in "+-"]


def problems(split: str, n: int, max_operand: int, seed: int, eval_fraction: float = 0.1,
             kind: str = "arithmetic") -> list[Problem]:
    """`n` problems of `split` ('train' or 'eval'): eval draws without replacement (at most the
    whole held-out pool), train samples with replacement when n exceeds its pool."""
    pool = [p for p in all_problems(max_operand, kind)
            if is_held_out(p, eval_fraction) == (split == "eval")]
    rng = random.Random(f"{seed}-{split}")
    if split == "eval":
        return rng.sample(pool, min(n, len(pool)))
    if n <= len(pool):
        return rng.sample(pool, n)
    return [rng.choice(pool) for _ in range(n)]


def chatml(p: Problem, worked: bool = False) -> str:
    """The same problem as a ChatML transcript (what `posttrain.data.tokenizer.CHAT_TEMPLATE`
    renders); pretraining corpora hold chat transcripts too, so the chat format is not new at SFT."""
    return (f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n"
            f"{p.reply(worked)}")


def _with_working(split: str, n: int, max_operand: int, seed: int, eval_fraction: float,
                  worked: float) -> list[tuple[Problem, bool]]:
    """The split's problems, each with whether its answer is worked (a share `worked`, drawn)."""
    rng = random.Random(f"{seed}-{split}-worked")
    return [(p, rng.random() < worked) for p in problems(split, n, max_operand, seed, eval_fraction)]


def text_rows(split: str, n: int, max_operand: int, seed: int, eval_fraction: float = 0.1,
              worked: float = 0.0) -> list[dict]:
    """Pretraining documents: every other one a chat transcript, the rest plain sentences."""
    return [{"text": chatml(p, w) if i % 2 else p.text(w)}
            for i, (p, w) in enumerate(_with_working(split, n, max_operand, seed, eval_fraction, worked))]


def chat_rows(split: str, n: int, max_operand: int, seed: int, eval_fraction: float = 0.1,
              worked: float = 0.0) -> list[dict]:
    return [{"messages": [{"role": "user", "content": p.question},
                          {"role": "assistant", "content": p.reply(w)}],
             "answer": str(p.answer)}
            for p, w in _with_working(split, n, max_operand, seed, eval_fraction, worked)]


def prompt_completion_rows(split: str, n: int, max_operand: int, seed: int, eval_fraction: float = 0.1,
                           worked: float = 0.0) -> list[dict]:
    return [{"prompt": p.question, "completion": f" {p.reply(w)}", "answer": str(p.answer)}
            for p, w in _with_working(split, n, max_operand, seed, eval_fraction, worked)]


def rows(fmt: str, split: str, n: int, max_operand: int, seed: int,
         eval_fraction: float = 0.1, worked: float = 0.0) -> list[dict]:
    return {"text": text_rows, "messages": chat_rows, "prompt_completion": prompt_completion_rows}[
        fmt](split, n, max_operand, seed, eval_fraction, worked)


# ---- the calculator task: multiplication, and a tool that does it ----------------------------------
def tool_chat(p: Problem, mode: str) -> dict:
    """An SFT chat for `p`: `mode` "call" (the calculator is offered and called, its result
    read back), "offered" (offered, the answer given straight) or "plain" (no tools)."""
    from posttrain.data.tokenizer import calculator_schema

    user = {"role": "user", "content": p.question}
    # a straight answer restates the problem first (which teaches the copying a tool call needs)
    final = {"role": "assistant", "content": f"{p.a} * {p.b} = {p.answer}. The answer is {p.answer}."}
    if mode == "plain":
        return {"messages": [user, final], "answer": str(p.answer)}
    msgs = [user, final]
    if mode == "call":
        call = {"type": "function", "function": {"name": "calculator",
                                                 "arguments": {"expression": f"{p.a} * {p.b}"}}}
        msgs = [user, {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": "calculator", "content": str(p.answer)},
                {"role": "assistant", "content": f"The answer is {p.answer}."}]
    return {"messages": msgs, "tools": [calculator_schema()], "answer": str(p.answer)}


def calculator_rows(fmt: str, split: str, n: int, max_operand: int, seed: int,
                    eval_fraction: float, tool_share: float) -> list[dict]:
    """The calculator task's rows. SFT chats (`messages`): a share `tool_share` call the
    calculator; of the rest, half are offered it and answer straight, half are plain chats (so
    that a recipe can also run without the tool). Prompts (`prompt_completion`): the question."""
    probs = problems(split, n, max_operand, seed, eval_fraction, "calculator")
    if fmt == "prompt_completion":
        return [{"prompt": p.question, "completion": f" The answer is {p.answer}.",
                 "answer": str(p.answer)} for p in probs]
    if fmt != "messages":
        raise ValueError("the calculator task has chats (messages) and prompts (prompt_completion)")
    rng = random.Random(f"{seed}-{split}-tools")
    out = []
    for p in probs:
        u = rng.random()
        out.append(tool_chat(p, "call" if u < tool_share else
                             "offered" if u < tool_share + (1 - tool_share) / 2 else "plain"))
    return out


def rows_for(g, fmt: str, split: str, n: int) -> list[dict]:
    """The rows of the generated task `g` (a `GeneratedData` section)."""
    if g.kind == "calculator":
        return calculator_rows(fmt, split, n, g.max_operand, g.seed, g.eval_fraction, g.tool_share)
    return rows(fmt, split, n, g.max_operand, g.seed, g.eval_fraction, g.worked)


def corpus_for_tokenizer(max_operand: int, kind: str = "arithmetic") -> list[str]:
    """Text covering every surface form the tokenizer must handle (all numbers, both ops; for
    the calculator task, its chats with the tool's schema and calls, rendered)."""
    if kind == "calculator":
        import json

        import jinja2

        from posttrain.data.tokenizer import CHAT_TEMPLATE

        env = jinja2.Environment()
        env.filters["tojson"] = json.dumps  # as transformers renders the template
        t = env.from_string(CHAT_TEMPLATE.replace("{% generation %}", "").replace(
            "{% endgeneration %}", ""))
        chats = [tool_chat(p, m) for p in all_problems(max_operand, kind)[::97] for m in ("call", "offered")]
        return corpus_for_tokenizer(max_operand) + [
            t.render(messages=c["messages"], tools=c.get("tools"), add_generation_prompt=False)
            for c in chats] + [p.text() for p in all_problems(max_operand, kind)[::7]]
    probs = all_problems(min(max_operand, 99))[:: 3]
    return [p.text() for p in probs] + [p.text(worked=True) for p in probs[1::4]] + [f"{i}" for i in range(-max_operand, 2 * max_operand + 1)] + [
        f"user\n{p.question}\nassistant\nThe answer is {p.answer}.\n" for p in probs[::5]] + [
        "system\nYou are a helpful assistant.\n", "<think>\n</think>\n<answer></answer>"]
