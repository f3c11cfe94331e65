"""Arithmetic problems the code generates, so that every CPU recipe runs without a download.

Problems are `a + b` and `a - b` over 0..max_operand. The train/eval split is by a hash of the
problem itself, so a held-out problem never appears in training data in any format (pretraining
text, SFT chats or RL prompts).
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
        return self.a + self.b if self.op == "+" else self.a - self.b

    def text(self) -> str:
        return f"{self.question} The answer is {self.answer}."


def is_held_out(p: Problem, eval_fraction: float = 0.1) -> bool:
    h = hashlib.sha256(f"{p.a}{p.op}{p.b}".encode()).digest()
    return int.from_bytes(h[:4], "little") / 2**32 < eval_fraction


def all_problems(max_operand: int) -> list[Problem]:
    return [Problem(a, b, op) for a in range(max_operand + 1) for b in range(max_operand + 1)
            for op in "+-"]


def problems(split: str, n: int, max_operand: int, seed: int, eval_fraction: float = 0.1) -> list[Problem]:
    """`n` problems of `split` ('train' or 'eval'): eval draws without replacement (at most the
    whole held-out pool), train samples with replacement when n exceeds its pool."""
    pool = [p for p in all_problems(max_operand) if is_held_out(p, eval_fraction) == (split == "eval")]
    rng = random.Random(f"{seed}-{split}")
    if split == "eval":
        return rng.sample(pool, min(n, len(pool)))
    if n <= len(pool):
        return rng.sample(pool, n)
    return [rng.choice(pool) for _ in range(n)]


def chatml(p: Problem) -> str:
    """The same problem as a ChatML transcript (what `posttrain.data.tokenizer.CHAT_TEMPLATE`
    renders); pretraining corpora hold chat transcripts too, so the chat format is not new at SFT."""
    return (f"<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n"
            f"The answer is {p.answer}.")


def text_rows(split: str, n: int, max_operand: int, seed: int, eval_fraction: float = 0.1) -> list[dict]:
    """Pretraining documents: every other one a chat transcript, the rest plain sentences."""
    return [{"text": chatml(p) if i % 2 else p.text()}
            for i, p in enumerate(problems(split, n, max_operand, seed, eval_fraction))]


def chat_rows(split: str, n: int, max_operand: int, seed: int, eval_fraction: float = 0.1) -> list[dict]:
    return [{"messages": [{"role": "user", "content": p.question},
                          {"role": "assistant", "content": f"The answer is {p.answer}."}],
             "answer": str(p.answer)} for p in problems(split, n, max_operand, seed, eval_fraction)]


def prompt_completion_rows(split: str, n: int, max_operand: int, seed: int, eval_fraction: float = 0.1) -> list[dict]:
    return [{"prompt": p.question, "completion": f" The answer is {p.answer}.",
             "answer": str(p.answer)} for p in problems(split, n, max_operand, seed, eval_fraction)]


def rows(fmt: str, split: str, n: int, max_operand: int, seed: int,
         eval_fraction: float = 0.1) -> list[dict]:
    return {"text": text_rows, "messages": chat_rows, "prompt_completion": prompt_completion_rows}[
        fmt](split, n, max_operand, seed, eval_fraction)


def corpus_for_tokenizer(max_operand: int) -> list[str]:
    """Text covering every surface form the tokenizer must handle (all numbers, both ops)."""
    probs = all_problems(min(max_operand, 99))[:: 3]
    return [p.text() for p in probs] + [f"{i}" for i in range(-max_operand, 2 * max_operand + 1)] + [
        f"user\n{p.question}\nassistant\nThe answer is {p.answer}.\n" for p in probs[::5]] + [
        "system\nYou are a helpful assistant.\n", "<think>\n</think>\n<answer></answer>"]
