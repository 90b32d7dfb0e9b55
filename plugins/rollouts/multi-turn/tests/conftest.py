import pytest
from miles.testing import char_tokenizer

CHARS = "0123456789+-*=()<>/{}[]\":,._ abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@pytest.fixture
def tok():
    return char_tokenizer(CHARS)
