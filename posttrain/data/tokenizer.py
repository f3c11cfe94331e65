"""Tokenizers: load an HF tokenizer, or train a byte-level BPE locally with `tokenizers` and save it
in HF format (tokenizer.json + tokenizer_config.json with a ChatML chat template) so that
transformers and vLLM load it like any hub tokenizer."""

from __future__ import annotations

from pathlib import Path

from posttrain.errors import UserError
from posttrain.tools import calculator, tool_schema

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL = [EOS, IM_START, IM_END]
# ChatML, as Qwen uses; {% generation %} marks assistant tokens for return_assistant_tokens_mask.
# With `tools`, a system turn lists their JSON schemas first; an assistant message's `tool_calls`
# are written as Qwen3 / Hermes `<tool_call>` blocks (what `posttrain.tools.parse_hermes` reads) and
# a `tool` message is its own turn. Earlier turns are rendered verbatim: the template is prefix-
# stable, so a multi-turn episode's tokens are the template's (`rollout.episodes`).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\n<tools>\n' }}"
    "{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{{ message['content'] or '' }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% set f = call['function'] if 'function' in call else call %}"
    "{{ '<tool_call>\n{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{{ (f['arguments'] if f['arguments'] is string else f['arguments'] | tojson) + '}\n</tool_call>' }}"
    "{% endfor %}"
    "{{ '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def calculator_schema() -> dict:
    """The JSON schema of the built-in calculator tool, as the chat template shows it."""
    return tool_schema(calculator, "calculator")


def train_bpe(texts: list[str], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # Digits split one by one: arithmetic generalises far better than with merged numbers.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    # As Qwen3's instruct tokenizers: a turn (and a document) ends with <|im_end|>; padding is
    # <|endoftext|>.
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=EOS,
                                 chat_template=CHAT_TEMPLATE)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf.save_pretrained(out_dir)
    return hf


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    path = Path(path)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise UserError(f"{path}: no tokenizer (tokenizer.json) in this directory")
    return AutoTokenizer.from_pretrained(path)
