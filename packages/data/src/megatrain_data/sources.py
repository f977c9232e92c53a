"""Where a run's records come from: `data.dataset`'s files, `datasets` directories or hub names, or the names of a
LLaMA-Factory `dataset_info.json` registry (`data.dataset_dir`), each a `Source` with its format, columns and tags
(records.py reads them)."""

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DataError, missing_path
from .section import DataSection

# The fields each format reads (dataset_info.json's `columns` rename them); optional ones may be absent
DEFAULT_COLUMNS = {
    "alpaca": {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "history": "history",
        "system": "system",
        "chosen": "chosen",  # ranking entries
        "rejected": "rejected",
    },
    "sharegpt": {
        "messages": "conversations",
        "system": "system",
        "tools": "tools",
        "chosen": "chosen",
        "rejected": "rejected",
    },
    "messages": {"messages": "messages", "system": "system", "tools": "tools"},
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "tools": "tools"},
    "prompt": {"prompt": "prompt"},
}
DEFAULT_TAGS = {
    "sharegpt": {
        "role_tag": "from",
        "content_tag": "value",
        "user_tag": "human",
        "assistant_tag": "gpt",
        "observation_tag": "observation",
        "function_tag": "function_call",
        "system_tag": "system",
    },
    "messages": {
        "role_tag": "role",
        "content_tag": "content",
        "user_tag": "user",
        "assistant_tag": "assistant",
        "observation_tag": "tool",
        "function_tag": "function_call",
        "system_tag": "system",
    },
}
UNSUPPORTED_COLUMNS = ("audios", "chosen", "rejected", "kto_tag")  # (images and videos: multimodal.py)
PAIR_COLUMNS = ("chosen", "rejected")  # read in ranking entries only
# each dataset_info.json field's type, as LLaMA-Factory reads it: (the types, what to write)
ENTRY_TYPES = {
    "columns": (dict, "an object of column names"),
    "tags": (dict, "an object of role tags"),
    "file_name": (str, "a file name"),
    "hf_hub_url": (str, "a hub name"),
    "split": (str, "a split's name"),
    "subset": (str, "a subset's name"),
    "folder": (str, "a folder of the hub dataset's repository"),
    "formatting": (str, "alpaca or sharegpt"),
    "num_samples": (int, "a whole number of records, 1 or more"),
}
REGISTRY_KEYS = tuple(ENTRY_TYPES)  # (the fields megatrain reads)
RECORD_SUFFIXES = (".jsonl", ".json", ".parquet")  # the files of records `load_records` reads


@dataclass(frozen=True)
class Source:
    """One dataset to read, resolved from the config or a registry entry."""

    name: str
    location: str  # a path or a hub name
    formatting: str  # text | alpaca | sharegpt | messages | preference
    columns: dict = field(default_factory=dict)
    tags: dict = field(default_factory=dict)
    split: str = "train"
    subset: str | None = None
    num_samples: int | None = None
    ranking: bool = False  # a registry entry of chosen/rejected pairs (alpaca or sharegpt formatting)
    registered: bool = False  # an entry of dataset_info.json (its columns and tags apply), not a file of data.dataset
    folder: str | None = None  # a hub dataset's files in this folder of its repository (datasets' data_dir)

    @property
    def is_preference(self) -> bool:
        """Records of chosen/rejected pairs (preference.py reads them), not supervised examples."""
        return self.ranking or self.formatting == "preference"

    def column(self, key: str):
        return self.columns.get(key, DEFAULT_COLUMNS[self.formatting].get(key))

    def tag(self, key: str):
        return self.tags.get(key, DEFAULT_TAGS[self.formatting][key])


def _registry(data: DataSection) -> dict:
    path = Path(data.dataset_dir) / "dataset_info.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(
            f"data.dataset_dir {data.dataset_dir} has no dataset_info.json; write one (LLaMA-Factory's format) "
            "or set data.dataset to a file and data.format to its format"
        ) from None
    except json.JSONDecodeError as error:
        raise DataError(f"{path} is not valid JSON: {error}") from error


def _source_from_entry(name: str, entry: dict, data: DataSection) -> Source:
    where = f"{Path(data.dataset_dir) / 'dataset_info.json'} entry {name!r}"
    _check_entry_types(entry, where)
    unknown = sorted(set(entry) - set(REGISTRY_KEYS) - {"ranking", "ms_hub_url", "om_hub_url", "script_url"})
    ranking = bool(entry.get("ranking"))
    columns, tags = dict(entry.get("columns") or {}), dict(entry.get("tags") or {})
    bad = sorted(set(columns) & (set(UNSUPPORTED_COLUMNS) - (set(PAIR_COLUMNS) if ranking else set())))
    if bad or unknown:
        raise DataError(f"{where} uses {bad + unknown}, which megatrain does not support (text, images, videos)")
    formatting = entry.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise DataError(f"{where}: formatting {formatting!r} is not supported; use alpaca or sharegpt")
    if "file_name" in entry:
        location = str(Path(data.dataset_dir) / entry["file_name"])
    elif "hf_hub_url" in entry:
        location = entry["hf_hub_url"]
    else:
        raise DataError(f"{where} has neither file_name nor hf_hub_url")
    return Source(
        name,
        location,
        formatting,
        columns,
        tags,
        entry.get("split", "train"),
        entry.get("subset"),
        entry.get("num_samples"),
        ranking,
        registered=True,
        folder=entry.get("folder"),
    )


def resolve_sources(data: DataSection) -> list[Source]:
    """The datasets `data.dataset` names (comma-separated), through the registry when data.dataset_dir is set."""
    names = [name.strip() for name in data.dataset.split(",") if name.strip()]
    if data.mix_weights and len(data.mix_weights) != len(names):
        raise DataError(
            f"data.mix_weights has {len(data.mix_weights)} weights for {len(names)} datasets ({names}); give one each"
        )
    registry = _registry(data) if data.dataset_dir is not None else None
    sources = []
    for name in names:
        if registry is not None and name in registry:
            sources.append(_source_from_entry(name, registry[name], data))
        elif registry is not None and not Path(name).exists():
            raise DataError(
                f"dataset {name!r} is not in {Path(data.dataset_dir) / 'dataset_info.json'} "
                f"(it has {sorted(registry)}) and is not a file"
            )
        else:
            sources.append(Source(name, name, data.format))
    for source in sources:  # (a file that is not there, before anything else is asked of the data)
        if Path(source.location).suffix in RECORD_SUFFIXES and not Path(source.location).exists():
            raise DataError(f"dataset {source.name!r}: {missing_path(source.location)} does not exist; check the path")
    return sources


def _check_entry_types(entry, where: str) -> None:
    """Refuse an entry, or a field of it, of the wrong type (a list of columns, a num_samples of "ten"), naming it."""
    if not isinstance(entry, dict):
        raise DataError(f"{where} is a JSON {type(entry).__name__}; write an object with file_name (or hf_hub_url)")
    for key, (kind, what) in ENTRY_TYPES.items():
        value = entry.get(key)
        wrong = value is not None and (not isinstance(value, kind) or isinstance(value, bool))
        if wrong or (key == "num_samples" and value is not None and value < 1):
            raise DataError(f"{where}: {key} is {value!r}; write {what}")
