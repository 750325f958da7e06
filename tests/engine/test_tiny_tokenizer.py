"""The tiny checkpoints' tokenizer at a real vocabulary size (engine/tiny_model.py): every id
decodes to text, as in a published tokenizer (a random model streams text whatever it draws),
the added tokens sit at the top, and encoding is the small tokenizer's."""

from __future__ import annotations

import random

from engine.tiny_model import FILL_VOCAB, _train_tokenizer
from engine.tiny_template import SPECIAL_TOKENS, TEXT_TOKENS, VISION_TOKENS


def test_real_size_vocabulary_decodes_every_id():
    big, small = _train_tokenizer(FILL_VOCAB), _train_tokenizer(1024)
    assert big.get_vocab_size() == FILL_VOCAB
    added = TEXT_TOKENS + VISION_TOKENS
    assert [big.token_to_id(t) for t in added] == list(range(FILL_VOCAB - len(added), FILL_VOCAB))
    ids = random.Random(0).sample(range(len(SPECIAL_TOKENS), FILL_VOCAB - len(added)), 500)  # specials are skipped
    assert all(big.decode([i]) != "" for i in ids), "an id decodes to nothing"
    text = "The quick brown fox <think>jumps</think> over 12 lazy dogs."
    small_ids = small.encode(text).ids
    assert big.decode(big.encode(text).ids) == text == small.decode(small_ids)
    assert [big.id_to_token(i) for i in big.encode(text).ids] == [small.id_to_token(i) for i in small_ids]
