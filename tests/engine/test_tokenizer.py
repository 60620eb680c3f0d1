"""The engine's tokenizer (a private Rust backend copy, GIL released while it works) gives ``hf.encode``'s ids."""

import pytest

from nebula_engine.engine.tokenizer import Tokenizer
from tests.model_cases import HYBRID_AND_MLA_CASES, MODEL_CASES

ONE_CASE_PER_FAMILY = list({case.family: case for case in MODEL_CASES + HYBRID_AND_MLA_CASES}.values())
TEXTS = ["Hello world", "  leading spaces\n\nand\ttabs ", "<|im_start|>user\nhi<|im_end|>", "<s>[INST] x [/INST]",
         "héllo 中文 😀 e\u0301 ﬃ", "", "a" * 3000]


@pytest.mark.parametrize("case", ONE_CASE_PER_FAMILY, ids=str)
def test_encoding_equals_hugging_face(checkpoint_factory, case):
    tokenizer = Tokenizer(checkpoint_factory(case))
    for text in TEXTS:
        assert tokenizer.encode(text) == list(tokenizer.hf.encode(text, add_special_tokens=True)), text
        assert tokenizer.encode_plain(text) == list(tokenizer.hf.encode(text, add_special_tokens=False)), text
