"""Rebuild `sample/tokenizer/`: a tiny byte-level BPE tokenizer with a ChatML chat template.

It stands in for a real model's tokenizer in the demo and the tests (no model hub is reachable
there). Run from the repository root: `python sample/make_tokenizer.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

HERE = Path(__file__).resolve().parent / "tokenizer"
# The simulator's default EOS id is 2: keep <|im_end|> there.
SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call these tools:\n{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    'Answer a tool call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role != 'system' %}<|im_start|>{{ message.role }}\n"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{{ message.content or '' }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

CORPUS = [
    "You are a helpful assistant. Answer the question step by step.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog. Write a short poem about the sea.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "Explain how a hash table works, and when a binary search tree is better.",
]


def main() -> None:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer=trainer)
    HERE.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(HERE / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "model_max_length": 32768,
        "chat_template": CHAT_TEMPLATE,
    }
    (HERE / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    main()
