"""Rendering prompts with the model's chat template into the exact input IDs the workers send."""

from __future__ import annotations

import hashlib
import logging
import tempfile
from pathlib import Path
from typing import Any

from producer.errors import SetupError, one_line
from producer.prompts import Prompt, Rejected

# transformers warns on import that PyTorch is missing; the producer needs only its tokenizers.
logging.getLogger("transformers").addFilter(lambda record: "PyTorch was not found" not in record.getMessage())

from transformers import AutoTokenizer  # noqa: E402


class ChatTokenizer:
    def __init__(self, name_or_path: str) -> None:
        self.name = name_or_path
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as error:  # no such path or repo, or no tokenizer files in it
            reason = one_line(error)
            raise SetupError(f"cannot load the tokenizer FLEET_TOKENIZER={name_or_path}: {reason}") from error
        self.vocab_size = len(self.tokenizer)

    def encode(self, prompt: Prompt) -> list[int]:
        """The prompt's input IDs: given ones checked, messages rendered with `add_generation_prompt`."""
        if prompt.input_ids is not None:
            if max(prompt.input_ids) >= self.vocab_size:
                raise Rejected(f"input_ids has token {max(prompt.input_ids)} beyond the vocabulary ({self.vocab_size})")
            return prompt.input_ids
        try:
            encoding = self.tokenizer.apply_chat_template(
                prompt.messages, tools=prompt.tools, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except Exception as error:  # a template raises whatever jinja or its own checks raise
            raise Rejected(f"chat template failed: {type(error).__name__}: {error}") from error
        return list(encoding["input_ids"])

    def decode(self, ids: list[int]) -> str:
        """The text of `ids` with every special token kept, as SGLang returns it with skip_special_tokens off."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def tokenize(self, text: str) -> list[int]:
        """The ids of `text` as SpecForge tokenizes a rendered conversation: no special tokens added."""
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        """A whole conversation rendered with the chat template, as a trainer renders it (no generation prompt)."""
        return self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False)

    def name_of(self, ids: list[int]) -> list[str]:
        """The tokens of `ids` as the vocabulary spells them, to show where two sequences part."""
        return self.tokenizer.convert_ids_to_tokens(ids)

    def digest(self) -> str:
        """SHA-256 of the tokenizer as loaded, chat template included: equal digests make equal input IDs.

        It hashes what `save_pretrained` writes rather than the source directory, which is often the
        model's own, weights and all.
        """
        digest = hashlib.sha256()
        with tempfile.TemporaryDirectory() as directory:
            self.tokenizer.save_pretrained(directory)
            for path in sorted(Path(directory).rglob("*")):
                if path.is_file():
                    name = path.relative_to(directory).as_posix()
                    digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
        return digest.hexdigest()
