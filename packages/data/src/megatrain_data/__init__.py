"""A run's data as training rows: token arrays, text, record datasets (LLaMA-Factory registries, alpaca, sharegpt,
messages), chat templates and assistant masks, packing and mixing, preference pairs, records with images or
videos, and the batches each optimizer step takes. `load_token_data` loads what a `DataSection` describes."""

from .chat import ChatTemplate, encode_conversation, load_chat_template, render_conversation
from .errors import DataError
from .files import not_utf8_where
from .load import TokenData, load_token_array, load_token_data, run_tokenizer, weights_tokenizer
from .section import DATA_FORMATS, DataSection
from .tokens import (
    EOS_TOKEN,
    Tokens,
    builtin_corpus,
    check_tokens,
    document_start_ids,
    eos_token_text,
    load_tokenizer,
    pad_token_id,
    tokenize_text,
    train_tokenizer,
)
from .windows import (
    IGNORE_INDEX,
    Batch,
    PairWindows,
    TokenWindows,
    pack_pairs,
    sequence_lengths,
    sequence_of_tokens,
)

__all__ = [
    "DATA_FORMATS",
    "EOS_TOKEN",
    "IGNORE_INDEX",
    "Batch",
    "ChatTemplate",
    "DataError",
    "DataSection",
    "PairWindows",
    "TokenData",
    "TokenWindows",
    "Tokens",
    "builtin_corpus",
    "check_tokens",
    "document_start_ids",
    "encode_conversation",
    "eos_token_text",
    "load_chat_template",
    "load_token_array",
    "load_token_data",
    "load_tokenizer",
    "not_utf8_where",
    "pack_pairs",
    "pad_token_id",
    "render_conversation",
    "run_tokenizer",
    "sequence_lengths",
    "sequence_of_tokens",
    "tokenize_text",
    "train_tokenizer",
    "weights_tokenizer",
]
