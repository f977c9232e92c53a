"""The `data` section of a run's configuration: where its data is and how it becomes training rows.

Validated as it is built (a `DataError` names the key and the fix); the meta-package's config loads it from YAML."""

from dataclasses import asdict, dataclass, fields

from .errors import DataError

DATA_FORMATS = ("text", "alpaca", "sharegpt", "messages", "preference", "prompt")
# read from data.dataset's records alone (data.chat_template is not among them: `megatrain generate` of any run reads
# it); set beside data.text or data.tokens means "not the default", so a default changed here would refuse the runs
# saved before it (a run's config holds every value)
RECORD_SETTINGS = ("text_field", "train_on_prompt", "too_long")


@dataclass(frozen=True)
class DataSection:
    """Where a run's data is (one of tokens, text or dataset; none: the built-in corpus) and how it becomes rows of
    seq_len tokens."""

    tokens: str | None = None  # a .npy array of token ids
    text: str | None = None  # a UTF-8 text file, tokenized with `tokenizer` or a tokenizer trained on it
    # records: .jsonl/.json/.parquet files, `datasets` save_to_disk directories, hub dataset names, or
    # names in dataset_dir/dataset_info.json; several comma-separated (or a YAML list) are mixed
    dataset: str | None = None
    dataset_dir: str | None = None  # a LLaMA-Factory-style folder with dataset_info.json
    mix_weights: tuple[float, ...] | None = None  # one per dataset: its share of the examples
    # text: pre-training on `text_field`; alpaca / sharegpt / messages: fine-tuning, loss on assistant turns;
    # preference: TRL's prompt / chosen / rejected pairs, as strings or conversations (train.objective: dpo);
    # prompt: TRL's prompt-only records, other columns going to the reward functions (train.objective: grpo)
    format: str = "text"
    text_field: str = "text"
    tokenizer: str | None = None  # tokenizer.json; default: the model directory's, else trained on the text
    chat_template: str | None = None  # None: the tokenizer's own; "simple"; or a .jinja file
    train_on_prompt: bool = False  # also train on system/user turns and the template's text
    seq_len: int = 256
    too_long: str = "truncate"  # an example longer than seq_len: truncate | drop (counted and reported)
    pack: bool = False  # several whole examples per row, each attending only to itself
    shuffle: bool = True
    # held-out data for validation loss: a fraction of the examples (0.05), a file, or a split name
    validation: float | str | None = None

    def as_key(self) -> dict:
        """The settings that change tokenized data (cache keys)."""
        return asdict(self)

    def __post_init__(self):
        if sum(x is not None for x in (self.tokens, self.text, self.dataset)) > 1:
            raise DataError("set only one of data.tokens (.npy token ids), data.text (a text file) or data.dataset")
        if self.format not in DATA_FORMATS:
            raise DataError(f"data.format must be one of {DATA_FORMATS}, got {self.format!r}")
        if self.format != "text" and self.dataset is None:
            given = "data.text is a text file" if self.text else "data.tokens are token ids" if self.tokens else ""
            raise DataError(
                f"data.format {self.format!r} reads records: set data.dataset to a .jsonl/.parquet file"
                + (f" ({given}: data.format text reads it)" if given else "")
            )
        for name in ("chat_template", "tokenizer", "text", "tokens", "validation"):
            if isinstance(getattr(self, name), str) and not getattr(self, name).strip():
                raise DataError(f"data.{name} is empty: name what it takes, or leave it out")
        if self.dataset is not None and not any(name.strip() for name in self.dataset.split(",")):
            raise DataError(f"data.dataset names no dataset ({self.dataset!r}): name a file, directory or hub dataset")
        if self.mix_weights is not None and self.dataset is None:
            raise DataError("data.mix_weights weigh the datasets of data.dataset: name them there, or leave it out")
        if self.dataset_dir is not None and self.dataset is None:
            raise DataError("data.dataset_dir is set: name the dataset_info.json entries to train on in data.dataset")
        if self.too_long not in ("truncate", "drop"):
            raise DataError(f"data.too_long must be truncate or drop, got {self.too_long!r}")
        if self.pack and self.dataset is None:
            raise DataError("data.pack packs fine-tuning examples: set data.dataset (text streams are already packed)")
        if self.text is not None or self.tokens is not None:
            self.check_record_settings()
        if isinstance(self.validation, float) and not 0 < self.validation < 1:
            raise DataError(
                f"data.validation as a fraction must be in (0, 1), got {self.validation}; leave it out (null) to hold "
                "out nothing"
            )
        if self.mix_weights is not None and any(w <= 0 for w in self.mix_weights):
            raise DataError(f"data.mix_weights must be positive, got {list(self.mix_weights)}")
        if self.seq_len < 2:
            raise DataError(f"data.seq_len must be >= 2 (one input and one target), got {self.seq_len}")
        if self.format == "preference":
            self.check_pair_settings()

    def check_record_settings(self) -> None:
        """Refuse, beside data.text or data.tokens, the settings only records read (they were taken and ignored)."""
        given = [
            f"data.{f.name}" for f in fields(self) if f.name in RECORD_SETTINGS and getattr(self, f.name) != f.default
        ]
        if given:
            what = "data.text is a text file, read as one stream" if self.text else "data.tokens are token ids"
            raise DataError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to the records of data.dataset; "
                f"{what}: leave {'it' if len(given) == 1 else 'them'} out"
            )

    def check_pair_settings(self) -> None:
        """Refuse the settings preference pairs cannot take (data.format preference here; ranking registry
        entries when they are read)."""
        if self.train_on_prompt:
            raise DataError(
                "data.train_on_prompt applies to supervised examples; DPO trains the completions only: "
                "set data.train_on_prompt: false"
            )


# The data.format a record's fields suggest, the first whose fields it has (chat before the others).
FORMAT_BY_FIELDS = (
    ("messages", {"messages"}),
    ("messages", {"conversations"}),
    ("preference", {"chosen", "rejected"}),
    ("alpaca", {"instruction", "output"}),
    ("prompt", {"prompt"}),
    ("text", {"text"}),
)


def fix_for_record(record: dict, what: str) -> str:
    """The setting that reads `record`, which lacks the `what` field its data.format needs: the format its fields
    suggest, or for text the one text field it has."""
    fields = {name for name, field in record.items() if field is not None}
    half_a_pair = {"chosen", "rejected"} & fields
    if len(half_a_pair) == 1:  # (a preference record short of its other answer, not a prompt-only one)
        return f"give each record its {({'chosen', 'rejected'} - half_a_pair).pop()} answer beside {half_a_pair.pop()}"
    for name, needs in FORMAT_BY_FIELDS:
        if needs <= fields and what not in needs:
            return f"set data.format: {name} (its fields are that format's)"
    texts = [name for name in sorted(fields) if isinstance(record[name], str)]
    if what == "text" and len(texts) == 1:
        return f"set data.text_field: {texts[0]} (its one text field)"
    return "set data.format (or the registry's columns) to match the records"
