"""Multimodal records (LLaMA-Factory's `messages` + `images` form) -> rows with media, through a tiny local
Qwen2.5-VL's own processor: the expanded ids equal transformers' processor on the model's chat template, only
assistant turns are trained, a run through the CLI trains and writes metrics, bad records stop it in one line
before training, and `megatrain data --text` shows where the image tokens sit."""

import importlib.util
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers  # installed by the integration nox session
import yaml
from PIL import Image
from test_image_text import FAMILIES
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers.processing_utils import ProcessorMixin

from megatrain.cli import main
from megatrain_data import DataError, DataSection, load_token_data
from megatrain_data.multimodal import MediaRows, MultimodalRows, check_media_model

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
SPECIAL_TOKENS += ["<|image_pad|>", "<|video_pad|>"]
PAD, TURN_START, TURN_END, VISION_START, VISION_END, IMAGE, VIDEO = range(len(SPECIAL_TOKENS))
VOCAB = 320
# Qwen2.5-VL's chat template, cut to what these records use: image and video content items as Qwen's
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "user assistant system What is in this picture? Compare the two images. A red square, a blue sky. hello"


class ImageOnlyQwenProcessor(transformers.Qwen2_5_VLProcessor):
    """Qwen2.5-VL's processor without its video processor. transformers (>= 5.4) builds that one, and loads the
    whole processor, only with torchvision, whose wheels must match torch's build: the CPU test machines have
    none. Everything a record with images goes through is Qwen2.5-VL's own code."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


class _ImageOnlyConfig(transformers.PretrainedConfig):
    model_type = "megatrain_test_image_only"  # (registers the processor by its name, Qwen2.5-VL's mapping untouched)


def qwen_processor(tokenizer):
    """Qwen2.5-VL's processor with small images (a few patches each)."""
    size = {"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 8}
    if importlib.util.find_spec("torchvision") is not None:
        image_processor = transformers.Qwen2VLImageProcessor(size=size)
        video_processor = transformers.Qwen2VLVideoProcessor(size=size)
        return transformers.Qwen2_5_VLProcessor(image_processor, tokenizer, video_processor, chat_template=TEMPLATE)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    transformers.AutoProcessor.register(_ImageOnlyConfig, ImageOnlyQwenProcessor, exist_ok=True)
    return ImageOnlyQwenProcessor(Qwen2VLImageProcessorPil(size=size), tokenizer, chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2.5-VL directory: random weights, a byte-level BPE tokenizer with Qwen's special tokens, the
    processor and the chat template."""
    directory = tmp_path_factory.mktemp("qwen_vl")
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(
        [WORDS] * 4,
        trainers.BpeTrainer(
            vocab_size=VOCAB - 8, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, show_progress=False
        ),
    )
    assert [bpe.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf = FAMILIES["qwen2_5_vl"] | dict(vocab_size=VOCAB, image_token_id=IMAGE, video_token_id=VIDEO)
    hf |= dict(vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, bos_token_id=TURN_START)
    hf |= dict(eos_token_id=TURN_END, pad_token_id=PAD)
    config = transformers.AutoConfig.for_model("qwen2_5_vl", **hf)
    torch.manual_seed(0)
    transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32).save_pretrained(directory)
    qwen_processor(tokenizer).save_pretrained(directory)
    return directory


def write_image(path, height: int, width: int, seed: int) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)
    return path.name


def write_dataset(directory, records: list[dict]) -> None:
    """records as mllm_demo.json beside dataset_info.json, as LLaMA-Factory's own mllm_demo is registered."""
    (directory / "mllm.json").write_text(json.dumps(records))
    tags = dict(role_tag="role", content_tag="content", user_tag="user", assistant_tag="assistant")
    entry = dict(file_name="mllm.json", formatting="sharegpt", tags=tags)
    entry["columns"] = dict(messages="messages", images="images", videos="videos")
    (directory / "dataset_info.json").write_text(json.dumps({"mllm": entry}))


def conversation(question: str, answer: str) -> list[dict]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def demo_records(directory, n: int = 6) -> list[dict]:
    """Records of one image, two images (of other sizes) and none."""
    records = []
    for i in range(n):
        if i % 3 == 2:
            records.append({"messages": conversation("hello", "hello"), "images": [], "videos": []})
            continue
        images = [
            write_image(directory / f"{i}-{k}.png", 40 + 16 * k, 60 - 8 * i, seed=10 * i + k) for k in range(1 + i % 3)
        ]
        question = "<image>" * len(images) + (
            "What is in this picture?" if len(images) == 1 else "Compare the two images."
        )
        records.append({"messages": conversation(question, f"A red square, {i}."), "images": images, "videos": []})
    return records


def data_section(directory, **settings) -> DataSection:
    return DataSection(dataset="mllm", dataset_dir=str(directory), seq_len=96, shuffle=False, **settings)


def test_ids_equal_the_processor_and_only_assistant_turns_train(model_dir, tmp_path):
    records = demo_records(tmp_path)
    write_dataset(tmp_path, records)
    loaded = load_token_data(data_section(tmp_path), VOCAB, tmp_path / "cache", model_dir, TURN_END)
    assert isinstance(loaded.train, MediaRows)
    rows = MultimodalRows(loaded.train, batch_size=len(records), shuffle=False, seed=0)
    batch = rows.batch(0)
    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    for row, record in enumerate(records):
        items = [{"type": "image"}] * len(record["images"]) + [
            {"type": "text", "text": record["messages"][0]["content"].replace("<image>", "")}
        ]
        messages = [{"role": "user", "content": items}, record["messages"][1]]
        images = [Image.open(tmp_path / name).convert("RGB") for name in record["images"]]
        text = processor.apply_chat_template(messages, tokenize=False)
        expected = processor(text=[text], images=images or None, add_special_tokens=False, return_tensors="pt")
        length = int(batch.valid[row].sum())
        ids = batch.input_ids[row, :length]
        assert torch.equal(ids, expected["input_ids"][0])
        grid = expected.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
        assert int((ids == IMAGE).sum()) == int(grid.prod(-1).sum()) // 4  # (merge_size 2: 4 patches a token)
        media = batch.media[row]
        if images:
            assert torch.equal(media["pixel_values"], expected["pixel_values"])
            assert torch.equal(media["image_grid_thw"], grid)
        assert "pixel_values" not in media or images
        assert media["mm_token_type_ids"].shape == (1, 96)
        targets = batch.labels[row][batch.labels[row] != -100]  # (labels[t]: the target of position t)
        answer = processor.tokenizer(record["messages"][1]["content"] + "<|im_end|>", add_special_tokens=False)
        assert targets.tolist() == answer["input_ids"]


def test_a_messages_file_with_images_beside_it_reads_without_a_registry(model_dir, tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    records = demo_records(folder, n=3)
    (folder / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = DataSection(dataset=str(folder / "chat.jsonl"), format="messages", seq_len=96)
    loaded = load_token_data(data, VOCAB, tmp_path / "cache", model_dir, TURN_END)
    assert [len(row.images) for row in loaded.train.inputs] == [len(r["images"]) for r in records]
    assert all(path.startswith(str(folder)) for row in loaded.train.inputs for path in row.images)


def run_config(tmp_path, model_dir, data: dict | None = None, model: dict | None = None, **train) -> str:
    config = {
        "model": {"hf_dir": str(model_dir)} | (model or {}),
        "data": {"dataset": "mllm", "dataset_dir": str(tmp_path), "seq_len": 96} | (data or {}),
        "train": {"steps": 2, "batch_size": 2, "micro_batch_size": 1, "lr": 1e-3, "warmup_steps": 0} | train,
        "precision": {"compute_dtype": "float32"},
        "device": "cpu",
        "output_dir": str(tmp_path / "run"),
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_run_through_the_cli_trains_on_images_and_dumps_them(model_dir, tmp_path, capsys):
    write_dataset(tmp_path, demo_records(tmp_path, n=8))
    path = run_config(tmp_path, model_dir, data={"validation": 0.25}, eval_every=2)
    assert main(["train", "--config", path]) == 0
    assert "dataset mllm: 8 records -> 8 examples" in capsys.readouterr().err
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2] and all(np.isfinite(m["loss"]) for m in steps)
    evals = [m for m in metrics if "val_loss" in m]
    assert [m["step"] for m in evals] == [2]
    final = tmp_path / "run" / "final"  # (the whole image-text model, its processor's files beside it)
    processor_files = [(final / name).exists() for name in ("preprocessor_config.json", "processor_config.json")]
    assert any(processor_files) and (final / "tokenizer.json").exists()
    assert main(["eval", "--config", path, "--checkpoint", str(final)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["data"] == "validation" and result["val_loss"] == pytest.approx(evals[0]["val_loss"], rel=1e-5)

    assert main(["data", "--config", path, "--dump", "2", "--text"]) == 0
    shown = capsys.readouterr().out
    assert "<|vision_start|><image x 2><|vision_end|>" in shown and "<|image_pad|>" not in shown
    assert re.search(r"<\|im_start\|>assistant\n⟦A red square, \d\.<\|im_end\|>⟧", shown), shown


def bad_records(tmp_path) -> dict:
    """What a record does wrong -> (the record, what its one line says)."""
    image = write_image(tmp_path / "ok.png", 40, 40, seed=1)
    (tmp_path / "broken.png").write_bytes(b"not a png")
    (tmp_path / "clip.mp4").write_bytes(b"\0" * 64)
    ask = "<image>What is in this picture?"
    return {
        "missing": ({"images": ["nowhere.png"]}, "image 'nowhere.png' does not exist"),
        "undecodable": ({"images": ["broken.png"]}, "cannot be decoded"),
        "more placeholders": (
            {"images": [image], "question": "<image>" + ask},
            "2 <image> placeholders in its text but 1 images",
        ),
        "more images": ({"images": [image, image]}, "1 <image> placeholders in its text but 2 images"),
        "video, no decoder": ({"videos": ["clip.mp4"], "question": "<video>What is this?"}, "install"),
    }


@pytest.mark.parametrize("case", ["missing", "undecodable", "more placeholders", "more images", "video, no decoder"])
def test_a_bad_record_stops_the_run_in_one_line(case, model_dir, tmp_path, capsys, monkeypatch):
    change, says = bad_records(tmp_path)[case]
    if case == "video, no decoder":  # (a machine with a video decoder checks the refusal as one without it would)
        import transformers.utils
        import transformers.video_utils

        monkeypatch.setattr(transformers.utils, "is_torchcodec_usable", lambda **kwargs: False, raising=False)
        monkeypatch.setattr(
            transformers.video_utils, "is_torchvision_video_decoding_available", lambda: False, raising=False
        )
    records = demo_records(tmp_path, n=3)
    question = change.get("question", "<image>What is in this picture?")
    records.insert(2, {"messages": conversation(question, "Yes."), "images": [], "videos": []} | change)
    records[2].pop("question", None)
    write_dataset(tmp_path, records)
    assert main(["train", "--config", run_config(tmp_path, model_dir)]) == 2
    line = said(capsys)
    assert "dataset 'mllm': record 3" in line and says in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def said(capsys) -> str:
    """megatrain's one line on stderr (datasets' progress bars aside)."""
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("megatrain:")]
    assert len(lines) == 1, lines
    return lines[0]


def text_model_dir(model_dir, directory):
    """A tiny Qwen2 text model with the image-text model's tokenizer and processor files beside it."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=TURN_END,
    )
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "processor_config.json"):
        (directory / name).write_bytes((model_dir / name).read_bytes())
    return directory


def test_images_for_a_text_model_or_packed_rows_are_refused(model_dir, tmp_path, capsys):
    write_dataset(tmp_path, demo_records(tmp_path, n=3))
    text_model = text_model_dir(model_dir, tmp_path / "text_model")
    assert main(["train", "--config", run_config(tmp_path, text_model)]) == 2
    line = said(capsys)
    assert "dataset 'mllm': record 1 has images" in line and "qwen2 has no vision tower" in line, line
    assert main(["train", "--config", run_config(tmp_path, model_dir, data={"pack": True})]) == 2
    assert "set data.pack: false" in said(capsys)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_images_for_the_text_model_of_an_image_text_model_are_refused(model_dir):
    rows = MediaRows(None, [], str(model_dir), {}, "dataset 'mllm': record 4")
    text_model = SimpleNamespace(image_text=False, arch="Qwen2_5_VLForConditionalGeneration")
    with pytest.raises(DataError, match="record 4 has images .* set model.image_text: true"):
        check_media_model(rows, text_model, str(model_dir))


def test_images_without_the_models_processor_are_refused(model_dir, tmp_path):
    write_dataset(tmp_path, demo_records(tmp_path, n=3))
    tokenizer = tmp_path / "tokenizer.json"
    Tokenizer(models.BPE()).save(str(tokenizer))
    with pytest.raises(DataError, match="set model.hf_dir"):
        load_token_data(data_section(tmp_path, tokenizer=str(tokenizer)), VOCAB, tmp_path / "cache", None)
    text_model = text_model_dir(model_dir, tmp_path / "text_model")
    (text_model / "processor_config.json").unlink()  # (AutoProcessor gives it its tokenizer alone)
    with pytest.raises(DataError, match="has no (image )?processor"):
        load_token_data(data_section(tmp_path), VOCAB, tmp_path / "cache", text_model, TURN_END)
