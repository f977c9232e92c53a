"""Every export serves as trained: a run's final/ and `megatrain convert` of the run, of its checkpoints and of a run
without final/ hold the data's tokenizer (else the model directory's), the chat template trained with, the special
tokens and a generation config that stops at the end of a turn; transformers' AutoTokenizer renders a conversation
as training did, and `megatrain generate` serves it. The commands run as a user runs them, as subprocesses."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from chat_templates import SPECIAL_TOKENS, TEMPLATES
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from megatrain_data import builtin_corpus
from megatrain_zoo import config_to_hf, preset

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>"]
SPECIALS += ["<|start_header_id|>", "<|end_header_id|>"]
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
]
CLI_DRIVER = Path(__file__).parents[1] / "packages" / "megatrain" / "tests" / "cli_driver.py"
EXPORTED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
EXPORTED += ("generation_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny Llama directories written by transformers with a byte-level BPE tokenizer: one whose tokenizer ships
    Llama 3.1's chat template (its turns end in <|eot_id|>), one with no template."""
    root = tmp_path_factory.mktemp("models")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=600, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([builtin_corpus().read_text()[:40000]], bpe)
    hf_config = transformers.AutoConfig.for_model(**(config_to_hf(preset("tiny-llama")) | {"vocab_size": 640}))
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    directories = (root / "llama-template", root / "no-template")
    for directory, template in zip(directories, (TEMPLATES["llama-3.1"], None)):
        model.save_pretrained(directory)
        tokenizer.save(str(directory / "tokenizer.json"))
        settings = SPECIAL_TOKENS["llama-3.1"] | ({"chat_template": template} if template else {})
        (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directories


def run_commands(command_lines: list[list[str]], cwd: Path, succeed: bool = True) -> list[dict]:
    """Each command line's exit code and output, run one after another by the console script's `main` in a
    subprocess (cli_driver.py); checked to succeed unless `succeed` is False."""
    process = subprocess.run(
        [sys.executable, str(CLI_DRIVER)],
        input="".join(json.dumps(argv) + "\n" for argv in command_lines),
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=600,
    )
    assert process.returncode == 0, process.stderr
    results = [json.loads(line) for line in process.stdout.splitlines()]
    for result in results:
        assert result["code"] == 0 or not succeed, (result["argv"], result["output"])
    return results


def read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write: without write permission, or for root (who may write there anyway)
    one in sysfs."""
    if os.geteuid() == 0:
        return Path("/sys/kernel")
    path = tmp_path / "read-only"
    path.mkdir()
    path.chmod(0o500)
    return path


def settings(*pairs: str) -> list[str]:
    common = ["device=cpu", "train.batch_size=2", "train.micro_batch_size=2", "train.lr=1e-3", "train.save_every=1"]
    return [arg for pair in (*common, *pairs) for arg in ("--set", pair)]


def rendered_by_transformers(export: Path) -> list[int]:
    """The conversation's ids as transformers' tokenizer of the export renders it."""
    out = transformers.AutoTokenizer.from_pretrained(export).apply_chat_template(CONVERSATION, tokenize=True)
    return out if isinstance(out, list) else list(out["input_ids"])


def training_ids(result: dict, length: int) -> list[int]:
    """The first `length` ids of the row `megatrain data --dump 1` printed (the conversation as training rendered
    it), checked to be followed by padding alone."""
    ids = json.loads(result["output"].strip().splitlines()[-1])["input_ids"]
    assert len(set(ids[length:])) <= 1, ids  # (the conversation is all of the row)
    return ids[:length]


def check_served_as_trained(export: Path, trained: list[int], end_of_turn: str) -> None:
    """The export holds every serving file; transformers renders the conversation as training rendered it, and
    generation stops at the template's end of turn, then at the tokenizer's EOS."""
    assert all((export / name).exists() for name in EXPORTED), sorted(p.name for p in export.iterdir())
    assert rendered_by_transformers(export) == trained, export
    tokenizer = Tokenizer.from_file(str(export / "tokenizer.json"))
    stops = json.loads((export / "generation_config.json").read_text())["eos_token_id"]
    assert transformers.AutoModelForCausalLM.from_pretrained(export).generation_config.eos_token_id == stops
    stops = stops if isinstance(stops, list) else [stops]
    assert stops[0] == tokenizer.token_to_id(end_of_turn) and tokenizer.token_to_id("<|eot_id|>") in stops


def test_fine_tuned_exports_hold_the_template_trained_with(model_dirs, tmp_path):
    """data.chat_template: my.jinja (ChatML) over a model whose own template is Llama 3.1's: final/, convert of the
    run, of its checkpoints/, of an older step-N and of the run once final/ is gone all render the conversation as
    training did (`megatrain data`) and stop at <|im_end|>; `generate` on a conversation serves final/. A model with
    no template trains with the simple one, and its export renders that (and serves a conversation)."""
    with_template, without = model_dirs
    (tmp_path / "my.jinja").write_text(TEMPLATES["qwen2.5"])
    (tmp_path / "chats.jsonl").write_text(4 * (json.dumps({"messages": CONVERSATION}) + "\n"))
    (tmp_path / "ask.jsonl").write_text(json.dumps({"prompt": CONVERSATION[:2]}) + "\n")
    data = ["data.dataset=chats.jsonl", "data.format=messages", "data.seq_len=96", "train.steps=2"]
    run, plain = tmp_path / "run", tmp_path / "plain"
    chatml = settings(f"model.hf_dir={with_template}", *data, "data.chat_template=my.jinja", f"output_dir={run}")
    simple = settings(f"model.hf_dir={without}", *data, f"output_dir={plain}")
    commands = [
        ["train", *chatml],
        ["data", *chatml, "--dump", "1"],
        ["convert", str(run), "converted-run"],
        ["convert", str(run / "checkpoints"), "converted-checkpoints"],
        ["convert", str(run / "checkpoints" / "step-00000001"), "converted-step-1"],
        ["generate", "--checkpoint", str(run), "--prompts", "ask.jsonl", "--max-new-tokens", "2"],
        ["train", *simple],
        ["data", *simple, "--dump", "1"],
        ["generate", "--checkpoint", str(plain), "--prompts", "ask.jsonl", "--max-new-tokens", "2"],
    ]
    results = run_commands(commands, tmp_path)
    assert "tokenizer, chat template, generation stopping at <|im_end|>, <|eot_id|>" in results[2]["output"]
    for generated in (results[5], results[8]):  # (the second: a conversation, and a model that had no template)
        assert json.loads(generated["output"].strip().splitlines()[-1])["prompt"] == CONVERSATION[:2]
    trained = training_ids(results[1], len(rendered_by_transformers(run / "final")))
    exports = [run / "final", *(tmp_path / f"converted-{name}" for name in ("run", "checkpoints", "step-1"))]
    for export in exports:
        check_served_as_trained(export, trained, "<|im_end|>")
    assert rendered_by_transformers(with_template) != trained  # (not the model's own template)
    # the simple template ends a turn with the data's EOS, the tokenizer's (<|eot_id|>; the model names none)
    check_served_as_trained(
        plain / "final", training_ids(results[7], len(rendered_by_transformers(plain / "final"))), "<|eot_id|>"
    )

    shutil.rmtree(run / "final")  # a run stopped before its export (a kill, a NaN stop): convert writes it whole,
    (tmp_path / "my.jinja").unlink()  # with the template trained with, though its file is gone
    run_commands([["convert", str(run), "converted-unfinished"]], tmp_path)
    check_served_as_trained(tmp_path / "converted-unfinished", trained, "<|im_end|>")


def test_a_run_on_token_ids_exports_the_model_directorys_tokenizer(model_dirs, tmp_path):
    """data.tokens brings no tokenizer: final/ and convert of a checkpoint or of a run without final/ hold the model
    directory's (its chat template, its EOS), and `generate --checkpoint RUN` serves it."""
    with_template = model_dirs[0]
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 600, 2000, dtype=np.int32))
    (tmp_path / "ask.txt").write_text("def main(\n")
    run = tmp_path / "run"
    train = ["train", *settings(f"model.hf_dir={with_template}", "data.tokens=ids.npy", "data.seq_len=32")]
    commands = [
        [*train, "--set", "train.steps=2", "--set", f"output_dir={run}"],
        ["generate", "--checkpoint", str(run), "--prompts", "ask.txt", "--max-new-tokens", "2"],
        ["convert", str(run / "checkpoints" / "step-00000001"), "converted-step-1"],
    ]
    results = run_commands(commands, tmp_path)
    assert json.loads(results[1]["output"].strip().splitlines()[-1])["prompt"] == "def main("
    shutil.move(run / "final", tmp_path / "served")  # (away from its run: served by what it holds alone)
    (tmp_path / "a-file").write_text("")
    unwritable = [read_only_dir(tmp_path) / "model", tmp_path / "a-file" / "model"]  # (the second: for root too)
    commands = [
        ["convert", str(run), "converted-unfinished"],
        ["generate", "--checkpoint", "served", "--prompts", "ask.txt", "--max-new-tokens", "2"],
        *(["convert", str(run), str(out)] for out in unwritable),
    ]
    written, generated, *refused = run_commands(commands, tmp_path, succeed=False)
    assert written["code"] == 0 and "tokenizer, chat template, generation stopping at <|eot_id|>" in written["output"]
    assert generated["code"] == 0 and json.loads(generated["output"].strip().splitlines()[-1])["prompt"] == "def main("
    for result, out in zip(refused, unwritable):  # one line naming the DIR it was given, not a run's output_dir
        line = result["output"].strip()
        assert result["code"] == 1 and len(line.splitlines()) == 1 and str(out) in line and "output_dir" not in line
    for export in (tmp_path / "served", tmp_path / "converted-step-1", tmp_path / "converted-unfinished"):
        assert (export / "tokenizer.json").read_bytes() == (with_template / "tokenizer.json").read_bytes()
        assert rendered_by_transformers(export) == rendered_by_transformers(with_template)
        stops = json.loads((export / "generation_config.json").read_text())["eos_token_id"]
        assert stops == Tokenizer.from_file(str(export / "tokenizer.json")).token_to_id("<|eot_id|>")


def test_a_base_with_a_list_of_eos_ids_is_exported_with_the_list(model_dirs, tmp_path):
    """Llama 3.1's config.json names three EOS ids; the model's config keeps the first alone, and the export's
    config.json said only that one."""
    base = tmp_path / "base"
    shutil.copytree(model_dirs[1], base)
    config = json.loads((base / "config.json").read_text())
    config["eos_token_id"] = [0, 4, 2]  # (<|endoftext|>, <|eot_id|>, <|im_end|>: special tokens of its tokenizer)
    (base / "config.json").write_text(json.dumps(config))
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 600, 2000, dtype=np.int32))
    run = tmp_path / "run"
    train = settings(f"model.hf_dir={base}", "data.tokens=ids.npy", "data.seq_len=32", "train.steps=1")
    run_commands([["train", *train, "--set", f"output_dir={run}"]], tmp_path)
    assert json.loads((run / "final" / "config.json").read_text())["eos_token_id"] == [0, 4, 2]


def test_convert_writes_the_step_its_weights_hold(model_dirs, tmp_path):
    """trainer_state.json, as final/ holds it: convert of a checkpoint says the checkpoint's step, of the run its
    final/'s, of a model directory of no run's none (and --overwrite of an export that said one leaves none)."""
    np.save(tmp_path / "ids.npy", np.random.default_rng(0).integers(0, 256, 2000, dtype=np.int32))
    run, model_dir = tmp_path / "run", model_dirs[1]
    train = settings("model.preset=tiny-llama", "data.tokens=ids.npy", "data.seq_len=32", "train.steps=2")
    commands = [
        ["train", *train, "--set", f"output_dir={run}"],
        *(["convert", str(run / "checkpoints" / "step-00000001"), out] for out in ("step-1", "replaced")),
        ["convert", str(run), "of-run"],
        ["convert", str(model_dir), "of-model"],
        ["convert", str(model_dir), "replaced", "--overwrite"],
    ]
    run_commands(commands, tmp_path)
    assert json.loads((tmp_path / "step-1" / "trainer_state.json").read_text()) == {"global_step": 1, "max_steps": 2}
    state = (run / "final" / "trainer_state.json").read_text()
    assert json.loads(state)["global_step"] == 2 and (tmp_path / "of-run" / "trainer_state.json").read_text() == state
    assert not any((tmp_path / out / "trainer_state.json").exists() for out in ("of-model", "replaced"))


def test_a_preset_trained_on_its_own_tokenizer_is_served_with_that_tokenizers_special_ids(tmp_path):
    """A preset's bos/eos ids (Gemma's 2 and 1) over the tokenizer megatrain trains name ordinary bytes of it: the
    export's config.json and generation config take the tokenizer's <|endoftext|> for the EOS and no BOS, so that
    transformers stops where training ended documents (it stopped at every `!`)."""
    run_commands([["train", *settings("model.preset=tiny-gemma3", "data.seq_len=32", "train.steps=1")]], tmp_path)
    run = tmp_path / "runs" / "default" / "final"
    config, generation = (json.loads((run / name).read_text()) for name in ("config.json", "generation_config.json"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(run)
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    assert tokenizer.eos_token == "<|endoftext|>" and config.get("bos_token_id") is None
    assert tokenizer.pad_token == "<|endoftext|>"  # (transformers' batched pipelines need one)
    assert config["eos_token_id"] == eos and generation["eos_token_id"] == eos
    assert transformers.AutoConfig.from_pretrained(run).eos_token_id == eos


def digits_merged_tokenizer(source: Path, tokenizer_class: str) -> Tokenizer:
    """A tokenizer.json trained with GPT-2's splits and digits merged (as megatrain trained one before it split as
    transformers does for Qwen models), in `source` beside a tokenizer_config.json naming `tokenizer_class`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    bpe = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["in 2024 and 12345 steps, 678 more; 13023 tokens"] * 50, bpe)
    source.mkdir()
    tokenizer.save(str(source / "tokenizer.json"))
    settings = {"tokenizer_class": tokenizer_class, "eos_token": "<|endoftext|>"}
    (source / "tokenizer_config.json").write_text(json.dumps(settings))
    return tokenizer


@pytest.mark.parametrize("named", ["Qwen2Tokenizer", "GemmaTokenizer", "GPT2Tokenizer"])
def test_an_export_names_a_tokenizer_class_that_encodes_as_trained(tmp_path, named, capsys):
    """A tokenizer.json trained with digits merged, beside a tokenizer_config.json naming a class transformers builds
    with its own pre-tokenizer (Qwen2Tokenizer splits digits one by one) or that refuses the vocabulary (Gemma's,
    without <unk>): the export (a Llama's) names PreTrainedTokenizerFast, and says so; a class that encodes as
    trained (GPT-2's) is kept. transformers' AutoTokenizer of the export then encodes as the trained tokenizer does."""
    from megatrain.export import write_hf_directory
    from megatrain_data.serving import PROBE_TEXT, Serving

    tokenizer = digits_merged_tokenizer(tmp_path / "source", named)
    out = write_hf_directory(
        tmp_path / "export", [], config_to_hf(preset("tiny-llama")), Serving(tmp_path / "source" / "tokenizer.json")
    )
    kept = named == "GPT2Tokenizer"
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == (
        named if kept else "PreTrainedTokenizerFast"
    )
    assert ("names PreTrainedTokenizerFast" in capsys.readouterr().err) != kept
    for text in (PROBE_TEXT, "in 2024 and 12345 steps<|endoftext|>"):
        served = transformers.AutoTokenizer.from_pretrained(out).encode(text, add_special_tokens=False)
        assert served == tokenizer.encode(text, add_special_tokens=False).ids


def test_an_export_whose_model_type_forces_a_tokenizer_class_says_how_to_load_it(tmp_path, capsys):
    """config.json's model_type qwen2 makes transformers build Qwen2Tokenizer whatever tokenizer_config.json names,
    which splits digits one by one over a tokenizer.json trained with GPT-2's splits: the export says so in one line
    naming the fix (PreTrainedTokenizerFast reads it as trained), and so does `describe_export`. The same files in a
    Llama's export are served as trained, without a word."""
    from megatrain.export import write_hf_directory
    from megatrain_data.serving import PROBE_TEXT, Serving, describe_export

    tokenizer = digits_merged_tokenizer(tmp_path / "source", "PreTrainedTokenizerFast")
    serving = Serving(tmp_path / "source" / "tokenizer.json")
    trained = tokenizer.encode(PROBE_TEXT, add_special_tokens=False).ids
    llama = write_hf_directory(tmp_path / "llama", [], config_to_hf(preset("tiny-llama")), serving)
    assert capsys.readouterr().err == "" and "from_pretrained" not in describe_export(llama)
    qwen = write_hf_directory(tmp_path / "qwen", [], config_to_hf(preset("tiny-qwen2")), serving)
    said = capsys.readouterr().err.strip()
    assert len(said.splitlines()) == 1 and "Qwen2Tokenizer (for config.json's model_type qwen2" in said
    assert "`PreTrainedTokenizerFast.from_pretrained(DIR)`" in said
    assert f"`PreTrainedTokenizerFast.from_pretrained({json.dumps(str(qwen))})`" in describe_export(qwen)
    assert transformers.AutoTokenizer.from_pretrained(qwen).encode(PROBE_TEXT, add_special_tokens=False) != trained
    assert (
        transformers.PreTrainedTokenizerFast.from_pretrained(qwen).encode(PROBE_TEXT, add_special_tokens=False)
        == trained
    )


def write_qwen_text(path: Path) -> None:
    """300 random lines of words with digits, accents and CJK, and the serving files' probe text (every byte of it
    known to the tokenizer trained)."""
    from megatrain_data.serving import PROBE_TEXT

    words = "the cat sat in 2024 with 12345 dogs and 3.14 pies on mat naïve café 日本語".split()
    rng = np.random.default_rng(0)
    path.write_text("".join(" ".join(rng.choice(words, 12)) + "\n" for _ in range(300)) + PROBE_TEXT * 3)


def test_a_qwen2_model_trained_from_scratch_is_encoded_by_transformers_as_trained(tmp_path):
    """A tiny-qwen2 run on text with digits: transformers builds Qwen2Tokenizer for its final/ whatever
    tokenizer_config.json names, and it encodes as the tokenizer megatrain trained (which splits digits one by one,
    as Qwen's does), so that transformers' generation reads what the model learned."""
    from megatrain_data.serving import PROBE_TEXT

    write_qwen_text(tmp_path / "digits.txt")
    run = tmp_path / "run"
    train = settings("model.preset=tiny-qwen2", "data.text=digits.txt", "data.seq_len=64", "train.steps=2")
    (result,) = run_commands([["train", *train, "--set", f"output_dir={run}"]], tmp_path)
    assert "from_pretrained" not in result["output"]
    served = transformers.AutoTokenizer.from_pretrained(run / "final")
    trained = Tokenizer.from_file(str(run / "final" / "tokenizer.json"))
    assert type(served).__name__ == "Qwen2Tokenizer"
    for text in (PROBE_TEXT, "the cat sat in 2024 with 12345 dogs\n\n naïve café 日本語"):
        assert served.encode(text, add_special_tokens=False) == trained.encode(text, add_special_tokens=False).ids


def test_a_qwen2_run_started_before_keeps_its_tokenizer_and_says_how_to_load_it(tmp_path):
    """A tiny-qwen2 run started before megatrain split text as Qwen's tokenizer does (its cache and tokenizer/ hold
    the tokenizer trained with GPT-2's splits, digits merged) is resumed with that tokenizer, not one trained anew;
    transformers' Qwen2Tokenizer does not read its export as trained, which the run says in one line naming the fix,
    as its last line does."""
    from megatrain_data import DataSection, load_token_array

    write_qwen_text(tmp_path / "digits.txt")
    run = tmp_path / "run"
    train = settings("model.preset=tiny-qwen2", "data.text=digits.txt", "data.seq_len=64", f"output_dir={run}")
    run_commands([["train", *train, "--set", "train.steps=2"]], tmp_path)
    for made in (*(run / "cache").glob("tokenizer-*.json"), *(run / "cache").glob("tokens-*.npy")):
        made.unlink()  # (the run as megatrain left it before: its tokenizer as megatrain trained it then)
    _, started_with = load_token_array(DataSection(text=str(tmp_path / "digits.txt")), 256, run / "cache", None)
    shutil.copyfile(started_with, run / "tokenizer" / "tokenizer.json")
    (resumed,) = run_commands([["train", "--resume", str(run), "--set", "train.steps=3"]], tmp_path)
    final = run / "final"
    assert (final / "tokenizer.json").read_bytes() == started_with.read_bytes()
    fix = f"`PreTrainedTokenizerFast.from_pretrained({json.dumps(str(final))})`"
    said = [line for line in resumed["output"].splitlines() if "PreTrainedTokenizerFast.from_pretrained" in line]
    assert len(said) == 2 and "Qwen2Tokenizer" in said[0] and said[1].startswith("model written to") and fix in said[1]
    text = "the cat sat in 2024 with 12345 dogs"
    ids = Tokenizer.from_file(str(final / "tokenizer.json")).encode(text, add_special_tokens=False).ids
    assert transformers.PreTrainedTokenizerFast.from_pretrained(final).encode(text, add_special_tokens=False) == ids


KILLED_IN_EXPORT = """
import os, signal, sys
import megatrain.export as hf_io
from megatrain.cli import main

write = hf_io.write_safetensors

def write_then_die(path, *args, **kwargs):  # kill -9 once the export's first weights are on disk
    written = write(path, *args, **kwargs)
    if ".final.partial" in str(path):
        os.kill(os.getpid(), signal.SIGKILL)
    return written

hf_io.write_safetensors = write_then_die
sys.exit(main(sys.argv[1:]))
"""


def test_resume_finishes_an_export_killed_with_minus_9(tmp_path):
    """kill -9 while the last step's model is exported: --resume says the step is done and finishes the export, and
    the hidden partial export is gone."""
    run = tmp_path / "run"
    train = ["train", *settings("model.preset=tiny-llama", "data.seq_len=32", "train.steps=2", f"output_dir={run}")]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)}
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_EXPORT, *train], cwd=tmp_path, env=env, timeout=300)
    assert killed.returncode == -9 and (run / ".final.partial").exists() and not (run / "final").exists()
    resumed = subprocess.run(
        [sys.executable, "-m", "megatrain", "train", "--resume", str(run)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert "megatrain: step 2 is done; finishing the export" in resumed.stderr
    assert json.loads((run / "final" / "trainer_state.json").read_text())["global_step"] == 2
    assert not (run / ".final.partial").exists() and (run / "final" / "tokenizer.json").exists()
