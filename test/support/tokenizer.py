"""A word-level tokenizer over the mock server's words, built on the spot so that upstream's
bench_serving needs nothing from the hub."""

from __future__ import annotations

import json
from pathlib import Path

from support.mock_server import WORDS


def word_tokenizer(path: Path) -> Path:
    """Write the tokenizer into `path` (a directory) and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece()  # joins words with spaces
    trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>", "</s>"])
    tokenizer.train_from_iterator([" ".join(WORDS), "The mock answers in these words."], trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "[UNK]",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "model_max_length": 4096,
        "chat_template": "{% for m in messages %}{{ m['content'] }}\n{% endfor %}",
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
