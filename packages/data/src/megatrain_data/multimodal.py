"""Image and video records -> rows with media: LLaMA-Factory's multimodal records through the model's own processor.

A record's `<image>` / `<video>` placeholders become what the model's chat template emits for an image (video)
content item, or the processor's own placeholder token; the rendered conversation goes through the processor
(transformers' `AutoProcessor`) with the record's images and videos, which expands each placeholder to its number
of tokens and makes the pixel values and grids. Rows hold one example each (no packing); the trained tokens are
those of records.py (assistant turns), never a placeholder token. load.py hands records here where a dataset has
`images` / `videos` columns; `MultimodalRows` draws the steps' rows with each row's media for `Trainer.train_step`.
"""

import difflib
import functools
import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from megatrain_store.progress import progress

from .chat import ChatTemplate, render_conversation, special_token_ids, trained_tokens
from .conversations import record_where, to_conversation
from .errors import DataError
from .records import Examples, examples_of, render_error, to_rows
from .section import DataSection
from .sources import Source
from .tokens import Tokens
from .windows import Batch, PairWindows, TokenWindows

MEDIA_KINDS = ("images", "videos")
PLACEHOLDERS = {"images": "<image>", "videos": "<video>"}  # LLaMA-Factory's, in the records' text
ITEM_TYPES = {"images": "image", "videos": "video"}  # the chat templates' content item types
TEXT_ONLY_OUTPUTS = ("input_ids", "attention_mask")  # processor outputs that are not media


# ------------------------------------------------------------ the processor
@functools.lru_cache(maxsize=4)
def load_processor(model_dir: str):
    """The model's own processor (`transformers.AutoProcessor`), loaded once per directory."""
    try:
        import transformers
    except ImportError:
        raise DataError(
            "records with images are read by the model's processor: install transformers and pillow "
            "(pip install 'transformers>=5.0' pillow)"
        ) from None
    try:
        processor = transformers.AutoProcessor.from_pretrained(model_dir)
    except ImportError as error:  # (transformers >= 5.4 builds image-text processors with torchvision)
        raise DataError(
            f"the processor of {model_dir} cannot be loaded: {str(error).strip().splitlines()[0]}; install the "
            "package it names (image-text processors need pillow and torchvision, the build matching your torch)"
        ) from error
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(
            f"model.hf_dir {model_dir} has no processor transformers can load ({type(error).__name__}: "
            f"{str(error)[:200]}); copy the model's processor files (preprocessor_config.json or "
            "processor_config.json) into it"
        ) from error
    media = [getattr(processor, name, None) for name in ("image_processor", "video_processor")]
    if not hasattr(processor, "tokenizer") or not any(media):  # (AutoProcessor gives a text model its tokenizer)
        raise DataError(
            f"model.hf_dir {model_dir} has no image processor: records with images need an image-text model's "
            "directory, its processor files (preprocessor_config.json or processor_config.json) included"
        )
    return processor


def placeholder_tokens(processor) -> dict[str, str]:
    """The processor's own placeholder token text per media kind ("images" -> "<|image_pad|>")."""
    tokens = {"images": getattr(processor, "image_token", None), "videos": getattr(processor, "video_token", None)}
    return {kind: token for kind, token in tokens.items() if token}


def placeholder_ids(processor) -> dict[int, str]:
    """Token id -> "image" / "video" of the processor's placeholder tokens (what the processor repeats)."""
    convert = processor.tokenizer.convert_tokens_to_ids
    return {convert(token): ITEM_TYPES[kind] for kind, token in placeholder_tokens(processor).items()}


def video_support_missing(processor) -> str | None:
    """What to install for the processor to decode videos, or None when it can."""
    if getattr(processor, "video_processor", None) is None:
        return "torchvision (transformers builds the video processor with it; the build matching your torch)"
    try:
        from transformers.utils import is_torchcodec_usable
        from transformers.video_utils import is_torchvision_video_decoding_available

        usable = is_torchcodec_usable(decode="video") or is_torchvision_video_decoding_available()
    except ImportError:  # (another transformers version: torchcodec is its video decoder since 5.0)
        usable = importlib.util.find_spec("torchcodec") is not None
    return None if usable else "torchcodec (transformers decodes videos with it)"


def renders_items(template: ChatTemplate, kind: str, token: str) -> bool:
    """Does the chat template render an {"type": "image"} (or "video") content item as the processor's token?"""
    probe = [{"role": "user", "content": [{"type": ITEM_TYPES[kind]}, {"type": "text", "text": "?"}]}]
    try:
        return token in template.render(probe)[0]
    except Exception:  # a template of text content only may refuse content items; placeholders are used then
        return False


# ------------------------------------------------------------ records
def media_columns(source: Source, records) -> dict[str, str]:
    """kind ("images", "videos") -> the records' column holding its file paths: the registry's `columns`, else a
    field of that name (LLaMA-Factory's default)."""
    found = {}
    for kind in MEDIA_KINDS:
        column = source.columns.get(kind)
        if column is not None and column not in records.column_names:
            raise DataError(
                f"dataset {source.name!r}: its {kind} column {column!r} is not among its fields "
                f"{records.column_names}; fix the registry's columns"
            )
        column = column or kind
        if source.formatting != "text" and column in records.column_names:
            found[kind] = column
    return found


def media_base(source: Source, data: DataSection) -> Path:
    """Where relative media paths resolve: data.dataset_dir (LLaMA-Factory's media_dir), else the dataset file's
    folder."""
    if data.dataset_dir is not None:
        return Path(data.dataset_dir)
    location = Path(source.location)
    return location if location.is_dir() else location.parent


def media_paths(record: dict, column: str | None, kind: str, base: Path, where: str) -> list[str]:
    """The record's image (video) files as paths, relative ones under `base` (else as given, as LLaMA-Factory
    does); a missing file is refused."""
    value = record.get(column) if column is not None else None
    value = [] if value is None else [value] if isinstance(value, (str, dict)) else list(value)
    paths = []
    for item in value:
        item = item.get("path") if isinstance(item, dict) else item
        if not isinstance(item, str):
            raise DataError(f"{where}: its {kind} must be file paths, got {type(item).__name__}")
        path = Path(item).expanduser()
        if not path.is_absolute() and (base / path).exists():
            path = base / path
        if not path.is_file():
            raise DataError(
                f"{where}: {kind[:-1]} {item!r} does not exist (relative paths resolve against {base}); fix the path"
            )
        paths.append(str(path.resolve()))
    return paths


def open_image(path: str, where: str):
    """The image as RGB (LLaMA-Factory's conversion), or a DataError naming the file."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise DataError(f"{where}: image {path} cannot be decoded ({error}); replace or remove it") from error


def check_placeholders(messages: list[dict], counts: dict[str, int], where: str) -> None:
    """One `<image>` (`<video>`) placeholder in the text per image (video) of the record."""
    for kind, placeholder in PLACEHOLDERS.items():
        written = sum(m["content"].count(placeholder) for m in messages if isinstance(m["content"], str))
        if written != counts[kind]:
            raise DataError(
                f"{where} has {written} {placeholder} placeholders in its text but {counts[kind]} {kind}; "
                f"write one {placeholder} where each of its {kind} goes"
            )


def with_media(content, tokens: dict[str, str], items: dict[str, bool]):
    """A turn's text with its placeholders as the template takes them: content items ({"type": "image"}) where the
    template renders them, else the processor's own token in the text."""
    if not isinstance(content, str) or not any(placeholder in content for placeholder in PLACEHOLDERS.values()):
        return content  # (a turn of text alone renders as in text records)
    kind_of = {PLACEHOLDERS[kind]: kind for kind in tokens}
    pieces = re.split("(" + "|".join(map(re.escape, kind_of)) + ")", content)
    if not all(items[kind] for kind in tokens):
        return "".join(tokens[kind_of[piece]] if piece in kind_of else piece for piece in pieces)
    return [
        {"type": ITEM_TYPES[kind_of[piece]]} if piece in kind_of else {"type": "text", "text": piece}
        for piece in pieces
        if piece
    ]


def expand_trained(plain_ids: list[int], trained: list[bool], expanded_ids: list[int]) -> list[bool]:
    """The trained flags of `plain_ids` carried onto the processor's `expanded_ids` (the same text, each placeholder
    expanded to its tokens): tokens the two share keep their flag, the processor's own are never trained."""
    flags = [False] * len(expanded_ids)
    matcher = difflib.SequenceMatcher(None, plain_ids, expanded_ids, autojunk=False)
    for block in matcher.get_matching_blocks():
        flags[block.b : block.b + block.size] = trained[block.a : block.a + block.size]
    return flags


@dataclass(frozen=True)
class ProcessorInput:
    """What the processor reads to make one example: the rendered text and its media files."""

    text: str
    images: tuple[str, ...] = ()
    videos: tuple[str, ...] = ()


def run_processor(processor, item: ProcessorInput, where: str) -> dict:
    """The processor's outputs ([1, tokens] ids, media tensors) for one example."""
    images = [open_image(path, where) for path in item.images]
    try:
        return processor(
            text=[item.text],
            images=images or None,
            videos=list(item.videos) or None,
            add_special_tokens=False,  # (the chat template wrote the special tokens, as apply_chat_template)
            return_tensors="pt",
        )
    except Exception as error:  # processors raise many types; one line names the record and the error
        raise DataError(
            f"{where}: the model's processor refused it ({type(error).__name__}: {str(error)[:300]}); "
            "fix or remove the record"
        ) from error


# ------------------------------------------------------------ examples
@dataclass
class MediaExamples(Examples):
    """Examples (expanded token ids, trained flags) with what the processor reads to remake each one's media."""

    inputs: list[ProcessorInput] = field(default_factory=list)
    dropped_cut_media: int = 0  # longer than seq_len, truncation would have cut an image's tokens
    first_media: str | None = None  # "dataset 'x': record 3": its first record with an image or video

    def select(self, indices) -> "MediaExamples":
        return MediaExamples(
            [self.ids[i] for i in indices],
            [self.trained[i] for i in indices],
            len(indices),
            inputs=[self.inputs[i] for i in indices],
            first_media=self.first_media,
        )

    def extend(self, other: "MediaExamples") -> None:
        super().extend(other)
        self.inputs += other.inputs
        self.first_media = self.first_media or other.first_media

    def drop_notes(self, data: DataSection) -> list[str]:
        notes = super().drop_notes(data)
        if self.dropped_cut_media:
            notes.append(
                f"{self.dropped_cut_media} dropped as truncating them to seq_len {data.seq_len} would cut an image"
            )
        return notes

    @property
    def lost(self) -> int:
        return super().lost + self.dropped_cut_media


class MediaEncoder:
    """A run's records -> expanded token ids, trained flags and processor inputs, each record checked whole
    (files, placeholders, the processor's own run) when it is read."""

    def __init__(self, processor, template: ChatTemplate, tokenizer, data: DataSection):
        self.processor, self.template, self.tokenizer, self.data = processor, template, tokenizer, data
        self.tokens = placeholder_tokens(processor)
        self.items = {kind: renders_items(template, kind, token) for kind, token in self.tokens.items()}
        self.placeholders = placeholder_ids(processor)
        self.special = special_token_ids(tokenizer)
        self.video_missing = video_support_missing(processor)

    def check_media_support(self, counts: dict[str, int], where: str) -> None:
        if counts["images"] and getattr(self.processor, "image_processor", None) is None:
            raise DataError(f"{where} has images but the model's processor takes none; remove its images")
        if counts["videos"] and self.video_missing is not None:
            raise DataError(
                f"{where} has videos, which the model's processor cannot decode: install {self.video_missing}"
            )
        for kind in MEDIA_KINDS:
            if counts[kind] and kind not in self.tokens:
                raise DataError(f"{where} has {kind} but the model's processor has no placeholder token for them")

    def encode(
        self, record: dict, source: Source, index: int, columns: dict, base: Path
    ) -> tuple[list[int], list[bool], ProcessorInput, int]:
        """(expanded token ids, trained flags, processor input, tokens up to the last placeholder token) of one
        record."""
        import jinja2

        where = record_where(source, index)
        messages, tools = to_conversation(record, source, index)
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{where} has no assistant turn, so nothing to learn from; remove it or fix its roles")
        files = {kind: media_paths(record, columns.get(kind), kind, base, where) for kind in MEDIA_KINDS}
        counts = {kind: len(paths) for kind, paths in files.items()}
        check_placeholders(messages, counts, where)
        self.check_media_support(counts, where)
        messages = [m | {"content": with_media(m["content"], self.tokens, self.items)} for m in messages]
        try:
            text, spans, end_of_turn = render_conversation(self.template, messages, tools)
        except (jinja2.TemplateError, ValueError, TypeError) as error:
            raise render_error(source, index, error) from error
        item = ProcessorInput(text, tuple(files["images"]), tuple(files["videos"]))
        outputs = run_processor(self.processor, item, where)
        ids = outputs["input_ids"][0].tolist()
        placeholder = [token in self.placeholders for token in ids]
        if "mm_token_type_ids" in outputs:  # (the processor's own word on which tokens are media)
            placeholder = [p or bool(t) for p, t in zip(placeholder, outputs["mm_token_type_ids"][0].tolist())]
        if self.data.train_on_prompt:
            trained = [True] * len(ids)
        else:
            plain = self.tokenizer.encode(text, add_special_tokens=False)
            flags = trained_tokens(text, spans, end_of_turn, plain.ids, plain.offsets, self.special)
            trained = expand_trained(plain.ids, flags, ids)
        media_end = max((t + 1 for t, p in enumerate(placeholder) if p), default=0)
        return ids, [t and not p for t, p in zip(trained, placeholder)], item, media_end


def media_examples(records, source: Source, encoder: MediaEncoder, data: DataSection) -> MediaExamples:
    """Every record of a source encoded, after truncation or dropping of long examples (an example whose
    truncation would cut an image's tokens is dropped: the model needs all of them)."""
    columns, base = media_columns(source, records), media_base(source, data)
    examples = MediaExamples([], [], len(records))
    for index, record in enumerate(progress(records, desc=f"process {source.name}", unit="record", leave=False)):
        ids, trained, item, media_end = encoder.encode(record, source, index, columns, base)
        if len(ids) > data.seq_len:
            if data.too_long == "drop":
                examples.dropped_long += 1
                continue
            if media_end > data.seq_len:
                examples.dropped_cut_media += 1
                continue
            ids, trained = ids[: data.seq_len], trained[: data.seq_len]
            examples.truncated += 1
        if not any(trained[1:]):  # the first token is never a target
            examples.dropped_untrained += 1
            continue
        examples.ids.append(ids)
        examples.trained.append(trained)
        examples.inputs.append(item)
        if examples.first_media is None and (item.images or item.videos):
            examples.first_media = record_where(source, index)
    return examples


@dataclass
class MediaRows:
    """Rows of one example each (`Tokens`: ids, trained mask, padding) and per row what the processor reads to
    remake its media, from the processor of `model_dir`. `placeholders`: token id -> "image" / "video"."""

    rows: Tokens
    inputs: list[ProcessorInput]
    model_dir: str
    placeholders: dict[int, str]
    first_media: str | None  # "dataset 'x': record 3": the first record with an image or video, None when none

    @property
    def tokens(self) -> np.ndarray:
        return self.rows.tokens


def media_rows(
    data: DataSection,
    sources: list[Source],
    all_records: list,
    validation_records,
    tokenizer,
    template: ChatTemplate,
    pad_id: int,
    seed: int,
    model_dir: Path | None,
) -> tuple[MediaRows, MediaRows | None, list[str]]:
    """(training rows, validation rows or None, report lines) of image and video records: every record processed
    and checked now. Nothing is cached on disk: reading the data checks every image (decodes it), which is most
    of the work a cache would save."""
    if model_dir is None:
        raise DataError(
            "records with images are read by the model's processor: set model.hf_dir to the model's directory"
        )
    if data.pack:
        raise DataError(
            "data.pack packs text examples; an image-text model trains one example per row: set data.pack: false"
        )
    encoder = MediaEncoder(load_processor(str(model_dir)), template, tokenizer, data)

    def encode(records, source: Source) -> MediaExamples:
        return media_examples(records, source, encoder, data)

    train, validation, lines = examples_of(sources, all_records, validation_records, data, seed, encode)
    first_media = train.first_media

    def rows_of(examples: MediaExamples) -> MediaRows:
        rows = to_rows(examples, data.seq_len, False, pad_id)
        return MediaRows(rows, examples.inputs, str(model_dir), encoder.placeholders, first_media)

    return rows_of(train), rows_of(validation) if validation is not None else None, lines


# ------------------------------------------------------------ rows of a step
@dataclass
class MediaBatch(Batch):
    """A step's rows (`Batch`) and each row's media: its processor outputs other than the token ids, by transformers'
    forward argument names (`pixel_values` [patches, C*T*P*P], `image_grid_thw` [images, 3], ...; per-token ones
    such as `mm_token_type_ids` padded to [1, seq_len])."""

    media: list[dict[str, torch.Tensor]] = field(default_factory=list)


def media_of(batch: Batch) -> list[dict[str, torch.Tensor]] | None:
    """A batch's rows' media, a step's `StepBatch.media` (`Trainer.train_step` / `evaluate`): None for text rows."""
    return batch.media if isinstance(batch, MediaBatch) else None


def row_media(outputs: dict, ids: torch.Tensor, where: str) -> dict[str, torch.Tensor]:
    """One row's media from the processor's outputs of its example; `ids`: the row ([seq_len], padded)."""
    made = outputs["input_ids"][0]
    length = min(len(made), len(ids))
    if not torch.equal(made[:length], ids[:length].to(made.dtype)):
        raise DataError(f"{where}: its images changed since the data was read; start the run again")
    media = {}
    for name, value in outputs.items():
        if name in TEXT_ONLY_OUTPUTS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 2 and value.shape == (1, len(made)):  # per token (token types): cut and padded as the row
            padded = value.new_zeros(1, len(ids))
            padded[:, :length] = value[:, :length]
            value = padded
        media[name] = value
    return media


class MultimodalRows(TokenWindows):
    """Batches of image-text rows addressed by optimizer step, drawn (shuffled by seed, one pass after another)
    as TokenWindows draws rows, so that a resumed run sees the same rows. Token ids and trained masks are kept;
    each row's pixel values are remade by the processor when its step comes (they are far larger than its tokens,
    and a dataset's would not fit in memory), the same every time: the processors make them without randomness."""

    def __init__(self, data: MediaRows, batch_size: int, shuffle: bool, seed: int):
        super().__init__(data.rows, data.tokens.shape[1], batch_size, shuffle, seed)
        self.media_rows = data
        self.processor = load_processor(data.model_dir)

    def rows(self, indices: list[int]) -> MediaBatch:
        batch = super().rows(indices)
        media = []
        for row, index in enumerate(indices):
            item, where = self.media_rows.inputs[index], f"training row {index}"
            media.append(row_media(run_processor(self.processor, item, where), batch.input_ids[row], where))
        return MediaBatch(batch.input_ids, batch.labels, batch.position_ids, batch.valid, media=media)


def row_windows(tokens, seq_len: int, batch_size: int, shuffle: bool, seed: int) -> TokenWindows:
    """The batches of a run's rows: `MultimodalRows` for rows with media, else `TokenWindows`."""
    if isinstance(tokens, MediaRows):
        return MultimodalRows(tokens, batch_size, shuffle, seed)
    return TokenWindows(tokens, seq_len, batch_size, shuffle, seed)


def check_batches(data, seq_len: int, batch_size: int) -> None:
    """Refuse, before a model is loaded, a run's data (`TokenData`) that fills no step: training rows or pairs fewer
    than one batch, validation data of not one window. The windows say it again when they are cut, with the model
    in memory."""
    if data.pairs:
        PairWindows(data.train, batch_size, shuffle=False, seed=0)
        return
    TokenWindows(_tokens_of(data.train), seq_len, batch_size, shuffle=False, seed=0)
    if data.validation is None:
        return
    try:
        TokenWindows(_tokens_of(data.validation), seq_len, 1, shuffle=False, seed=0)
    except DataError:
        raise DataError(
            f"the validation data holds not one window of data.seq_len {seq_len}; give data.validation more (a larger "
            "fraction or a longer file), or set it to null"
        ) from None


def _tokens_of(rows) -> Tokens:
    return rows.rows if isinstance(rows, MediaRows) else rows


def check_media_model(data: MediaRows, model, hf_dir: str | None) -> None:
    """Refuse records with images for a model that trains as a text model, before the model is built."""
    if data.first_media is None or model.image_text:
        return
    has_tower = hf_dir is not None and bool(json.loads((Path(hf_dir) / "config.json").read_text()).get("vision_config"))
    fix = (
        "set model.image_text: true to train the whole image-text model"
        if has_tower
        else (f"{model.arch} has no vision tower: use an image-text model (model.hf_dir), or records without images")
    )
    raise DataError(f"{data.first_media} has images or videos but the model trains as a text model; {fix}")
