"""A character-level tokenizer built in code for the embedded default (tiny model, synthetic task).

Every printable ASCII character plus newline and tab is one token, after six special tokens with
fixed ids (`SPECIAL_TOKENS`). The tokenizer is assembled with the `tokenizers` library (a
`WordLevel` model over single characters, a per-character pre-tokenizer and a concatenating
decoder), wrapped as a `transformers` fast tokenizer with a small chat template, and written with
`save_pretrained` so that the ordinary `AutoTokenizer.from_pretrained(save_dir)` loading path works
offline. Nothing is downloaded.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
UNK_TOKEN = "<|unk|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"

# Fixed ids: pad=0, bos=1, eos=2, unk=3, user=4, assistant=5; characters follow from id 6.
SPECIAL_TOKENS: tuple[str, ...] = (
    PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN, USER_TOKEN, ASSISTANT_TOKEN,
)

# string.printable minus the rarely useful \r \x0b \x0c: digits, letters, punctuation (including
# the backslash and braces of \boxed{}), space, newline and tab.
CHARACTERS: tuple[str, ...] = tuple(c for c in string.printable if c not in "\r\x0b\x0c")

# One turn per message: a role token, the text, and an end-of-sequence token after assistant
# turns; the generation prompt is the assistant role token, so a reply is "<answer><|eos|>".
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' + message['content'] + eos_token }}"
    "{% else %}"
    "{{ '<|user|>' + message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def char_vocab() -> dict[str, int]:
    """The token -> id table: `SPECIAL_TOKENS` at ids 0..5, then `CHARACTERS` in order (< 128)."""
    tokens = SPECIAL_TOKENS + CHARACTERS
    return {token: i for i, token in enumerate(tokens)}


def build_char_tokenizer(save_dir: str | Path | None = None) -> PreTrainedTokenizerFast:
    """Builds the character-level tokenizer and, when `save_dir` is given, saves it there.

    Encoding never adds special tokens by itself (the chat template writes `<|bos|>`), unknown
    characters map to `<|unk|>`, and decoding concatenates characters without spaces. Padding is
    on the left, as prompts for generation are left-padded.

    Args:
      save_dir: directory to write (created if missing) in Hugging Face format; afterwards
        `transformers.AutoTokenizer.from_pretrained(save_dir)` returns an equivalent tokenizer.

    Returns:
      The tokenizer (`len(tokenizer) == len(char_vocab())`, ids of specials as in `SPECIAL_TOKENS`).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = char_vocab()
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Each character (newline included) becomes its own piece; the WordLevel model maps it to an id.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS))

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(str(save_dir))
    return tokenizer
