import pytest

from megatrain_data import builtin_corpus, train_tokenizer


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory):
    """A byte-level BPE tokenizer of 512 tokens trained on the start of the built-in corpus (the tests' tokenizer)."""
    text = tmp_path_factory.mktemp("tok") / "corpus.txt"
    text.write_text(builtin_corpus().read_text()[:50000])
    path = text.parent / "tokenizer.json"
    train_tokenizer(text, 512, path)
    return path
