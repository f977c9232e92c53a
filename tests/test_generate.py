"""Generation from the store's weights: greedy completions equal transformers' `generate` on the exported model (a
native family, a mixture of experts whose experts transformers holds fused, a family through transformers'
modules), prompts of different lengths in one batch; the completions' log-probabilities from the training forward
equal transformers' scores; the same seed samples the same completions."""

import json
import shutil

import pytest
import torch
import transformers
from test_exactness import rel_err

from megatrain import Trainer
from megatrain.config import Config, ModelSection, PrecisionSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import DataSection
from megatrain_zoo.generate import GROUPED_DECODING, Generator, Sampling, _until_stop, grouped_decoding_attention


def trainer_of(model: ModelSection, tmp_path, device="cpu") -> Trainer:
    config = Config(
        model=model,
        data=DataSection(seq_len=32),
        train=TrainSection(steps=1, batch_size=2, lr=1e-3, seed=int(torch.randint(0, 2**31 - 1, ()))),
        precision=PrecisionSection("float32"),
        device=device,
        output_dir=str(tmp_path / "run"),
    )
    return Trainer(config)


def prompts_of(generator: torch.Generator, vocab: int) -> list[list[int]]:
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (5, 9, 2)]


def check_greedy_equals_transformers(trainer: Trainer, tmp_path, weights="auto", decoding="eager") -> Generator:
    """Greedy completions of three prompts of different lengths, decoded together: transformers' `generate` of the
    same left-padded batch, token for token; each completion's log-probabilities from the training forward equal
    transformers' forward of the prompt and completion alone."""
    generator = torch.Generator().manual_seed(0)
    prompts = prompts_of(generator, trainer.model_config.vocab_size)
    sampling = Sampling(max_new_tokens=6, temperature=0.0, stop_ids=(2,))
    ours_generator = Generator(trainer, weights, decoding)
    ours = ours_generator.generate(prompts, sampling, pad_id=0)
    reference = transformers.AutoModelForCausalLM.from_pretrained(trainer.export(tmp_path / "out"), dtype=torch.float32)
    reference.to(trainer.device)
    for prompt, completion, expected in zip(prompts, ours, reference_greedy(reference, prompts, sampling)):
        assert completion == expected, (prompt, completion, expected)
        ids = torch.tensor([prompt + completion])
        labels = torch.full_like(ids, -100)
        labels[0, len(prompt) - 1 : -1] = torch.tensor(completion)
        logps = trainer.token_logps(StepBatch(ids, labels))[0, len(prompt) - 1 : -1]
        with torch.no_grad():
            scores = reference(ids.to(trainer.device)).logits[0, len(prompt) - 1 : -1].cpu().log_softmax(-1)
        assert rel_err(logps, scores.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1)) < 1e-5
    return ours_generator


def reference_greedy(reference, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
    """transformers' greedy completions of `prompts` left-padded into one batch, each cut after its first stop token.
    The batch, not each prompt alone: padding moves some families' numbers (Llama 4's chunked attention and attention
    temperature count positions from the batch's first column), and a near tie may then fall either way. (A load-balancing
    loss is no generation's: transformers' fails on a padded batch.)"""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, longest - len(prompt) :], mask[row, longest - len(prompt) :] = torch.tensor(prompt), 1
    device = reference.device
    router = {"output_router_logits": False} if hasattr(reference.config, "output_router_logits") else {}
    out = reference.generate(
        ids.to(device), attention_mask=mask.to(device), max_new_tokens=sampling.max_new_tokens, do_sample=False,
        eos_token_id=list(sampling.stop_ids), pad_token_id=0, **router,
    )  # fmt: skip
    return [_until_stop(row, sampling.stop_ids) for row in out[:, longest:].tolist()]


# (grouped heads; fused experts; soft-capped scores; a hybrid of linear attention; of Mamba layers; sinks and sliding
# windows; sliding windows over grouped heads; chunked attention; latent attention)
FAMILIES = ["tiny-llama", "tiny-mixtral", "tiny-gemma2", "tiny-qwen3.5", "tiny-granite-4.0-h", "tiny-gpt-oss"]
FAMILIES += ["tiny-gemma3", "tiny-llama4", "tiny-deepseek-v3"]


@pytest.mark.parametrize("preset_name", FAMILIES)
def test_greedy_generation_equals_transformers(preset_name, tmp_path):
    trainer = trainer_of(ModelSection(preset=preset_name), tmp_path)
    check_greedy_equals_transformers(trainer, tmp_path)
    trainer.close()


@pytest.mark.parametrize("preset_name", ["tiny-llama", "tiny-gemma2", "tiny-mixtral"])  # (see the GPU test)
def test_streamed_layers_generate_as_resident_ones(preset_name, tmp_path):
    """Parameters that are stored tensors stream from the store's own views; Mixtral's experts, which transformers
    holds stacked, from host copies of the converted tensors."""
    trainer = trainer_of(ModelSection(preset=preset_name), tmp_path)
    check_greedy_equals_transformers(trainer, tmp_path, weights="streamed")
    trainer.close()


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["resident", "streamed"])
@pytest.mark.parametrize("preset_name", ["tiny-llama", "tiny-gemma2"])
def test_gpu_greedy_generation_equals_transformers(preset_name, weights, tmp_path):
    """On the GPU: the layers' copies on their own stream, each waiting for its buffer to be free (with 3 layers
    the last layer's buffer is the next step's first layer's)."""
    trainer = trainer_of(ModelSection(preset=preset_name), tmp_path, device="cuda")
    check_greedy_equals_transformers(trainer, tmp_path, weights)
    trainer.close()


# (Llama 4: transformers 5.17's static cache fails for its chunked attention, which this test says there; such a run
# decodes eager, said in one line: `test_a_decoding_step_that_fails_compiled_decodes_eager`)
@pytest.mark.parametrize("preset_name", ["tiny-llama", "tiny-gemma2", "tiny-mixtral", "tiny-llama4"])
def test_a_static_kv_cache_generates_as_transformers(preset_name, tmp_path, monkeypatch):
    """Compiled decoding's cache (on the CPU, where transformers compiles nothing): a static KV cache of a multiple
    of STATIC_CACHE_STEP tokens, prompts of different lengths in one batch."""
    import megatrain_zoo.generate as generate

    lengths = []
    monkeypatch.setattr(Generator, "_compiles", lambda self, resident: resident)
    made = generate._static_cache
    monkeypatch.setattr(
        generate, "_static_cache", lambda config, length: lengths.append(length) or made(config, length)
    )
    trainer = trainer_of(ModelSection(preset=preset_name), tmp_path)
    generator = check_greedy_equals_transformers(trainer, tmp_path, "resident", "compiled")
    trainer.close()
    assert lengths == [generate.STATIC_CACHE_STEP] and generator.last_plan.compiled


FAILURES = [  # (how a compiled step fails: dynamo or inductor; transformers 5.17's static cache for Llama 4)
    torch._dynamo.exc.InternalTorchDynamoError("an operator inductor has no kernel for"),
    TypeError("create_chunked_causal_mask() got an unexpected keyword argument 'block_sequence_ids'"),
]


@pytest.mark.parametrize("failure", FAILURES, ids=lambda error: type(error).__name__)
def test_a_decoding_step_that_fails_compiled_decodes_eager(failure, tmp_path, monkeypatch, capsys):
    """A family whose compiled step fails: one line says so, the rollout and the next decode eager."""
    import megatrain_zoo.generate as generate

    def fails(config, length):
        raise failure

    monkeypatch.setattr(Generator, "_compiles", lambda self, resident: self.decoding == "compiled")
    monkeypatch.setattr(generate, "_static_cache", fails)
    trainer = trainer_of(ModelSection(preset="tiny-llama"), tmp_path)
    generator = check_greedy_equals_transformers(trainer, tmp_path, "resident", "compiled")
    trainer.close()
    said = capsys.readouterr().err
    assert f"compiled decoding step failed ({type(failure).__name__}: {failure}); decoding eager from now on" in said
    assert generator.decoding == "eager" and not generator.last_plan.compiled
    assert generator.last_plan.reason.endswith("decoding eager")


def test_a_step_that_will_not_compile_plans_its_kv_cache_at_its_own_length(tmp_path, monkeypatch):
    """`decoding: compiled` where the step decodes eager (here: on the CPU): the plan counts the sequences' own
    length, not the static cache's multiple of STATIC_CACHE_STEP, and says eager."""
    lengths = []
    planned = Generator.plan
    monkeypatch.setattr(Generator, "plan", lambda self, n, length: lengths.append(length) or planned(self, n, length))
    trainer = trainer_of(ModelSection(preset="tiny-llama"), tmp_path)
    generator = Generator(trainer, "resident", "compiled")
    generator.generate([[5, 6, 7]], Sampling(max_new_tokens=4, temperature=0.0), pad_id=0)
    trainer.close()
    assert lengths[-1] == 7 and not generator.last_plan.compiled
    assert generator.last_plan.reason == "on the CPU: weights resident, one batch, decoding eager"


@pytest.mark.parametrize("model_type", ["cohere2", "apertus"])  # (Apertus: buffers of the checkpoint's in its MLPs)
def test_greedy_generation_of_a_family_through_transformers_modules(model_type, tmp_path):
    from test_generic import hf_model, tiny_hf_config

    hf_model(tiny_hf_config(model_type), 0).save_pretrained(tmp_path / "hf")
    trainer = trainer_of(ModelSection(hf_dir=str(tmp_path / "hf")), tmp_path)
    check_greedy_equals_transformers(trainer, tmp_path)
    trainer.close()


def attention_with_repeated_heads(query, key, value, mask, scale):
    """Attention as written: every query head over its key/value head's copy, the masked positions left out."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    scores = (query @ key.transpose(-1, -2)) * scale
    return (scores.masked_fill(~mask, -torch.inf).softmax(-1) @ value).transpose(1, 2)


@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (6, 1), (4, 4)])
def test_grouped_decoding_attention_equals_attention_with_repeated_heads(heads, kv_heads):
    """One query token over grouped key/value heads under a left-padding mask; value heads wider than the keys'."""
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    batch, length, scale = 3, 11, 0.3
    query = torch.randn(batch, heads, 1, 16, generator=generator, dtype=torch.float64)
    key = torch.randn(batch, kv_heads, length, 16, generator=generator, dtype=torch.float64)
    value = torch.randn(batch, kv_heads, length, 24, generator=generator, dtype=torch.float64)
    mask = (torch.arange(length) >= torch.tensor([[0], [4], [9]])).view(batch, 1, 1, length)
    module = torch.nn.Module()
    module.num_key_value_groups = heads // kv_heads
    out, _ = grouped_decoding_attention(module, query, key, value, mask, scaling=scale)
    assert out.shape == (batch, 1, heads, 24)
    assert rel_err(out, attention_with_repeated_heads(query, key, value, mask, scale)) < 1e-12


def test_grouped_decoding_leaves_what_changes_the_scores_to_transformers(monkeypatch):
    """Soft-capped scores, biases, sinks, several queries, equal heads: transformers' SDPA attention's to run."""
    import transformers.integrations.sdpa_attention as sdpa

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", lambda *args, **kwargs: "transformers'")
    query, key = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 5, 8)
    module = torch.nn.Module()
    for term in ("softcap", "position_bias", "alibi", "s_aux"):
        assert grouped_decoding_attention(module, query, key, key, None, **{term: 1.0}) == "transformers'"
    assert grouped_decoding_attention(module, torch.randn(2, 4, 3, 8), key, key, None) == "transformers'"
    assert grouped_decoding_attention(module, query, query, query, None) == "transformers'"


def test_decoding_steps_attend_over_grouped_heads(tmp_path, monkeypatch):
    """A model of grouped key/value heads (tiny-llama: 4 query heads, 2 key/value) decodes its padded batch's
    steps through `grouped_decoding_attention`."""
    calls = []

    def counted(module, query, *args, **kwargs):
        calls.append(query.shape[2])
        return grouped_decoding_attention(module, query, *args, **kwargs)

    trainer = trainer_of(ModelSection(preset="tiny-llama"), tmp_path)
    generator = Generator(trainer)  # (registers the attention: counted from here on)
    assert generator.skeleton.config._attn_implementation == GROUPED_DECODING
    monkeypatch.setitem(transformers.AttentionInterface._global_mapping, GROUPED_DECODING, counted)
    prompts = prompts_of(torch.Generator().manual_seed(3), trainer.model_config.vocab_size)
    generator.generate(prompts, Sampling(max_new_tokens=4, temperature=0.0), pad_id=0)
    layers = trainer.model_config.n_layers
    assert calls == [max(len(p) for p in prompts)] * layers + [1] * layers * 3  # (the prompts' pass, 3 steps)
    trainer.close()


def test_the_kv_cache_grows_in_place_as_transformers_grows_its_own():
    """transformers' `generate` with the cache megatrain gives it: the same logits as with its own dynamic cache, for
    a left-padded batch, and each layer's keys and values at the end views of the buffers its first step made."""
    from transformers.generation.utils import ALL_CACHE_NAMES

    from megatrain_zoo.generate import _kv_cache

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(1, 64, (2, 5))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    options = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, output_logits=True)
    cache = _kv_cache(config, 5 + 4)
    ours = model.generate(ids, return_dict_in_generate=True, **options, **{ALL_CACHE_NAMES[0]: cache})
    theirs = model.generate(ids, return_dict_in_generate=True, **options)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert max(rel_err(a, b) for a, b in zip(ours.logits, theirs.logits)) < 1e-6
    for layer in cache.layers:
        assert layer.keys._base is layer.buffers[0] and layer.values._base is layer.buffers[1]
        length = ours.sequences.shape[1] - 1  # (the last token's keys are not cached: it was not run)
        assert layer.keys.shape == layer.values.shape == (2, 2, length, 8)


def test_the_same_seed_samples_the_same_completions(tmp_path):
    trainer = trainer_of(ModelSection(preset="tiny-llama"), tmp_path)
    generator = Generator(trainer)
    prompts = prompts_of(torch.Generator().manual_seed(1), 256) * 4
    sampling = Sampling(max_new_tokens=8, temperature=1.0, top_p=0.9, top_k=50)
    torch.manual_seed(5)
    state = torch.get_rng_state()
    first, again = (generator.generate(prompts, sampling, pad_id=0, seed=7) for _ in range(2))
    assert first == again and torch.equal(torch.get_rng_state(), state)
    assert generator.generate(prompts, sampling, pad_id=0, seed=8) != first
    assert len({tuple(c) for c in first}) > 3  # (sampled: the copies of a prompt differ)
    trainer.close()


def test_a_rows_sample_does_not_depend_on_the_rows_beside_it(tmp_path):
    """Generated in one batch or in two (as by two ranks, or KV batches of another size), each row samples the
    same completion: its noise is its own."""
    trainer = trainer_of(ModelSection(preset="tiny-llama"), tmp_path)
    generator = Generator(trainer)
    prompts = prompts_of(torch.Generator().manual_seed(2), 256) * 3
    sampling = Sampling(max_new_tokens=8, temperature=0.8, top_k=40)
    whole = generator.generate(prompts, sampling, pad_id=0, seed=11)
    split = generator.generate(prompts[:4], sampling, pad_id=0, seed=11)
    split += generator.generate(prompts[4:], sampling, pad_id=0, seed=11, first_row=4)
    assert whole == split and len({tuple(c) for c in whole}) > 3
    trainer.close()


def test_sampling_warps_the_repetition_penalised_scores(tmp_path, monkeypatch):
    """A sampled decoding step's warpers (RowSampler: temperature, top-k, top-p) see the scores after transformers'
    repetition penalty, as transformers' own sampling orders them: each prompt or completion token's score divided
    by the penalty where positive, multiplied where negative."""
    from megatrain_zoo import generate

    trainer = trainer_of(ModelSection(preset="tiny-llama"), tmp_path)
    seen, draw = [], generate.RowSampler.__call__
    monkeypatch.setattr(
        generate.RowSampler, "__call__", lambda self, ids, scores: seen.append((ids, scores)) or draw(self, ids, scores)
    )
    prompt = prompts_of(torch.Generator().manual_seed(3), 256)[1]
    sampling = Sampling(max_new_tokens=3, temperature=0.9, top_k=20, repetition_penalty=1.7)
    completion = Generator(trainer).generate([prompt], sampling, pad_id=0, seed=4)[0]
    reference = transformers.AutoModelForCausalLM.from_pretrained(trainer.export(tmp_path / "out"), dtype=torch.float32)
    for step, (ids, scores) in enumerate(seen):
        assert ids[0].tolist() == prompt + completion[:step]
        with torch.no_grad():
            logits = reference(ids).logits[:, -1].clone()
        taken = logits.gather(1, ids)
        logits.scatter_(1, ids, torch.where(taken < 0, taken * 1.7, taken / 1.7))
        assert rel_err(scores, logits) < 1e-5
    trainer.close()


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.7)])
def test_row_sampler_draws_from_the_warped_distribution(top_k, top_p):
    """Over many rows (keys), the Gumbel-max draws' frequencies match the softmax of transformers' warped logits."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from megatrain_zoo.generate import RowSampler, row_keys

    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ()))))
    rows, temperature = 200_000, 0.7
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    sampler = RowSampler(row_keys(3, torch.arange(rows)), prompt_length=4, sampling=sampling)
    draws = sampler(torch.zeros(rows, 6, dtype=torch.long), logits.expand(rows, -1)).argmax(-1)
    frequencies = torch.bincount(draws, minlength=12).double() / rows
    warped = logits / temperature
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    expected = warped.softmax(-1)[0].double()
    assert (frequencies - expected).abs().max() < 5 * (expected * (1 - expected) / rows).sqrt().max() + 1e-9
    assert (frequencies[expected == 0] == 0).all()


def test_the_plan_counts_streamed_generations_host_copies():
    """Streamed generation keeps host copies only of what transformers' loader converts (OLMoE's stacked experts),
    none for a family whose stored tensors are its parameters; resident generation none."""
    from megatrain.config import load_config
    from megatrain.planning import make_plan
    from megatrain_zoo import preset

    def plan(name: str, weights: str):
        overrides = [f"model.preset={name}", "data.seq_len=2048", "train.batch_size=16", "device=cpu"]
        overrides += ["precision.compute_dtype=bfloat16", "train.objective=grpo"]
        overrides += ["train.grpo.max_completion_length=1024", f"train.grpo.generation_weights={weights}"]
        return make_plan(load_config(None, overrides))

    assert plan("qwen2.5-7b", "streamed").generation_host_bytes == 0
    model = preset("olmoe-1b-7b")
    experts = model.n_layers * model.n_experts * 3 * model.d_model * model.moe_d_ff
    streamed, resident = plan("olmoe-1b-7b", "streamed"), plan("olmoe-1b-7b", "resident")
    assert streamed.generation_host_bytes == 2 * experts and resident.generation_host_bytes == 0

    def beside(plan, *names):
        return {name: size for name, size in plan.host_items.items() if name not in names}

    assert streamed.host_items["generation copies"] == 2 * experts and "generation copies" not in resident.host_items
    assert beside(streamed, "runtime", "generation copies") == beside(resident, "runtime")
    # on the CPU, resident generation's copy of the model is in host memory too (the device is the host)
    assert resident.host_items["runtime"] - streamed.host_items["runtime"] == 2 * model.n_params


def test_generate_reads_the_tokenizer_a_text_run_trained(tmp_path, capsys):
    """A run on text trains its own tokenizer: `megatrain generate` from any of its checkpoints reads that one (its
    final/'s, or with no final/ the run's cached one), as `eval` and `convert` do."""

    from megatrain.cli import main

    run = tmp_path / "run"
    settings = ["model.preset=tiny-llama", "device=cpu", "train.steps=2", "train.save_every=1", "data.seq_len=32"]
    settings += ["train.batch_size=2", "train.micro_batch_size=2", f"output_dir={run}"]
    assert main(["train", *(arg for setting in settings for arg in ("--set", setting))]) == 0
    (tmp_path / "ask.txt").write_text("def main(\n")
    for checkpoint in ("step-00000001", "step-00000002"):
        if checkpoint == "step-00000002":
            shutil.rmtree(run / "final")  # (this one reads the tokenizer cached in the run)
        capsys.readouterr()
        args = ["--checkpoint", str(run / "checkpoints" / checkpoint), "--prompts", str(tmp_path / "ask.txt")]
        assert main(["generate", *args, "--max-new-tokens", "3"]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out)["prompt"] == "def main("


def served_llama(hf_dir):
    """A tiny random Llama with a word-level tokenizer that starts a text with <bos>, saved as transformers saves
    them: (the model, the tokenizer)."""
    from test_generic import COMMON, hf_model
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    model = hf_model({**COMMON, "model_type": "llama"}, 0)
    model.save_pretrained(hf_dir)
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2} | {f"w{i}": i for i in range(3, 256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 1)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )
    fast.save_pretrained(hf_dir)
    return model, fast


def generate_cli(hf_dir, prompt: str, tmp_path, capsys, *flags: str) -> tuple[str, str]:
    """`megatrain generate` of one text prompt from the model in `hf_dir`: (its completion, what it said)."""
    from megatrain.cli import main

    (tmp_path / "ask.txt").write_text(prompt + "\n")
    args = ["--checkpoint", str(hf_dir), "--prompts", str(tmp_path / "ask.txt"), *flags]
    args += ["--set", f"output_dir={tmp_path / 'run'}", "--set", "device=cpu"]
    capsys.readouterr()
    assert main(["generate", *args]) == 0, capsys.readouterr().err
    out, err = capsys.readouterr()
    return json.loads(out)["completion"], err


def test_generate_starts_a_text_prompt_as_the_tokenizer_starts_a_text(tmp_path, capsys):
    """`megatrain generate` of a text prompt: the tokens transformers' `tokenizer(text)` gives (a BOS first where the
    tokenizer's post-processor puts one, as Llama's and Gemma's do and megatrain's text documents start), so its
    greedy completion equals transformers' generate of them."""
    model, fast = served_llama(tmp_path / "hf")
    completion, _ = generate_cli(tmp_path / "hf", "w5 w17 w3", tmp_path, capsys, "--max-new-tokens", "6")
    ids = fast("w5 w17 w3", return_tensors="pt")["input_ids"]
    assert ids[0, 0].item() == 1
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert completion == fast.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_generate_takes_what_the_models_generation_config_sets_as_transformers_does(tmp_path, capsys):
    """A model directory's generation_config.json (greedy, a repetition penalty, max_new_tokens; a min_p megatrain
    does not apply) decodes as transformers' `generate()` with no arguments decodes it, and says so; a flag overrides
    the file."""
    hf_dir = tmp_path / "hf"
    model, fast = served_llama(hf_dir)
    settings = {"repetition_penalty": 1.5, "max_new_tokens": 12, "min_p": 0.05, "eos_token_id": 2, "pad_token_id": 0}
    (hf_dir / "generation_config.json").write_text(json.dumps(settings))
    prompt = "w5 w17 w3 w5 w17"
    ids = fast(prompt, return_tensors="pt")["input_ids"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    penalised = reference.generate(ids, attention_mask=torch.ones_like(ids))[0, ids.shape[1] :]
    plain = reference.generate(ids, attention_mask=torch.ones_like(ids), repetition_penalty=1.0)[0, ids.shape[1] :]
    assert len(penalised) == 12 and not torch.equal(penalised, plain)  # (the penalty changes this completion)
    completion, said = generate_cli(hf_dir, prompt, tmp_path, capsys)
    assert completion == fast.decode(penalised, skip_special_tokens=True)
    assert "repetition_penalty 1.5, max_new_tokens 12, as" in said and "not applied" in said and "min_p 0.05" in said
    completion, _ = generate_cli(hf_dir, prompt, tmp_path, capsys, "--repetition-penalty", "1")
    assert completion == fast.decode(plain, skip_special_tokens=True)


@pytest.mark.parametrize(
    "settings",
    [
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9},  # (Llama 3.1 Instruct's)
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05},  # (Qwen2.5's)
        {"do_sample": True, "top_k": None, "temperature": None},
        {"do_sample": False, "temperature": 0.6, "repetition_penalty": 1.2},
        {},
    ],
)
def test_a_generation_configs_sampling_is_what_transformers_resolves(tmp_path, settings):
    """`file_sampling` of a generation_config.json: the temperature, top-p, top-k and repetition penalty transformers'
    `generate()` samples with (its defaults where the file leaves a setting out or null), temperature 0 where it does
    not sample."""
    from megatrain_zoo.generate import file_sampling

    (tmp_path / "generation_config.json").write_text(json.dumps(settings))
    resolved = transformers.GenerationConfig.from_pretrained(tmp_path)
    defaults = transformers.GenerationConfig._get_default_generation_params()
    value = {
        name: getattr(resolved, name) if getattr(resolved, name) is not None else defaults[name] for name in defaults
    }
    ours, unapplied = file_sampling(tmp_path)
    assert ours["repetition_penalty"] == value["repetition_penalty"] and unapplied == []
    if value["do_sample"]:
        assert (ours["temperature"], ours["top_p"], ours["top_k"]) == (
            value["temperature"],
            value["top_p"],
            value["top_k"],
        )
    else:
        assert ours["temperature"] == 0 and "top_k" not in ours


def test_generate_refuses_prompt_ids_past_the_models_vocabulary_in_one_line(tmp_path, capsys):
    """A tokenizer that is not the model's (`--set data.tokenizer` naming another) gives a prompt ids the model's
    embedding has no row for: `megatrain generate` refuses it in one line naming the prompt and the vocabulary."""
    import numpy as np
    from tokenizers import Tokenizer, models, pre_tokenizers

    from megatrain.cli import main

    np.save(tmp_path / "ids.npy", np.random.randint(0, 256, size=4096).astype(np.int32))
    run = tmp_path / "run"
    settings = ["model.preset=tiny-llama", "device=cpu", "train.steps=1", "data.seq_len=32", f"output_dir={run}"]
    settings += ["train.batch_size=2", "train.micro_batch_size=2", f"data.tokens={tmp_path / 'ids.npy'}"]
    assert main(["train", *(arg for setting in settings for arg in ("--set", setting))]) == 0
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(1000)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "other.json"))
    (tmp_path / "ask.txt").write_text("w5 w900\n")
    capsys.readouterr()
    args = ["--checkpoint", str(run), "--prompts", str(tmp_path / "ask.txt"), "--max-new-tokens", "2"]
    assert main(["generate", *args, "--set", f"data.tokenizer={tmp_path / 'other.json'}"]) == 2
    err = capsys.readouterr().err
    assert "prompt 1: token ids span [5, 900] but the model's vocab_size is 256" in err
    assert "Traceback" not in err
