"""Image-text models trained whole: the vision tower's blocks stream as pipeline stages before the decoder's layers.
Several optimizer steps of megatrain (fp32, micro-batches, clipped and eager, rows with images, a video clip or
none) equal transformers' image-text model + torch.optim.AdamW on the same processed inputs, with the tower, the
projector or the language model frozen (those keep no gradient and no optimizer state, and the backward stops where
nothing before it trains) or nothing; the exported directory reloads in transformers' image-text auto class with
equal weights and logits."""

import contextlib
import functools
import inspect

import pytest
import torch
import transformers  # installed by the integration nox session
from hf_steps import hf_labels, recurrences_token_by_token, rel_err, reload_export
from test_generic import adamw_decaying_matrices

from megatrain import Trainer
from megatrain.config import Config, EngineSection, ModelSection, PrecisionSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import DataSection
from megatrain_optim import Schedule, lr_at
from megatrain_templates import Media
from megatrain_zoo import model_config_from_hf

IMAGE, VIDEO, START, END = 250, 251, 252, 253
QWEN_VISION = dict(patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
TEXT = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# a Qwen tower's sizes and the tokens around its images
QWEN_TOWER = dict(hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, **QWEN_VISION)
QWEN_TOKENS = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
FIXED_SIZE_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, patch_size=14
)
FAMILIES = {
    "qwen2_5_vl": dict(
        **TEXT,
        **QWEN_TOKENS,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        tie_word_embeddings=False,
        vision_config=dict(depth=3, window_size=56, fullatt_block_indexes=[1], **QWEN_TOWER),
    ),
    # SigLIP's tower (its pooling head off, as Gemma 3's published configs have it), pooled to 4 tokens an image,
    # a tied head, soft caps and windows of its own decoder
    "gemma3": dict(
        text_config=dict(model_type="gemma3_text", **TEXT, sliding_window=4, query_pre_attn_scalar=16),
        vision_config=dict(model_type="siglip_vision_model", **FIXED_SIZE_VISION, image_size=56, vision_use_head=False),
        mm_tokens_per_image=4,
        image_token_index=IMAGE,
        boi_token_index=START,
        eoi_token_index=END,
    ),
    # CLIP's tower whose second-last block's output the projector takes (the last block is stored, never run)
    "llava": dict(
        text_config=dict(model_type="llama", **TEXT),
        vision_config=dict(model_type="clip_vision_model", **FIXED_SIZE_VISION, image_size=28, projection_dim=32),
        image_token_index=IMAGE,
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    ),
    # LLaVA-NeXT: an image as tiles at one of the grid's resolutions plus the whole image, their features unpadded
    # and a learned newline after each row
    "llava_next": dict(
        text_config=dict(model_type="llama", **TEXT),
        vision_config=dict(model_type="clip_vision_model", **FIXED_SIZE_VISION, image_size=28, projection_dim=32),
        image_token_index=IMAGE,
        image_grid_pinpoints=[[28, 28], [28, 56], [56, 28]],
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
    ),
    # Qwen3.5's tower (learned position embeddings) before its hybrid decoder (Gated DeltaNet on three of four
    # layers, transformers' own delta rule on both sides)
    "qwen3_5": dict(
        text_config=dict(
            model_type="qwen3_5_text",
            **TEXT,
            layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        )
        | dict(num_hidden_layers=4),
        vision_config=dict(depth=2, num_position_embeddings=16, **QWEN_TOWER),
        **QWEN_TOKENS,
    ),
    # Qwen3-VL: features merged from inside the tower (deepstack, after its first two blocks) added to the output of
    # the decoder's first two layers at the image tokens
    "qwen3_vl": dict(
        text_config=dict(
            model_type="qwen3_vl_text",
            **TEXT | dict(num_hidden_layers=3),
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        ),
        vision_config=dict(depth=3, deepstack_visual_indexes=[0, 1], num_position_embeddings=16, **QWEN_TOWER),
        **QWEN_TOKENS,
    ),
    # Llama 4's tower (2D rotary positions, a class token, its patches shuffled into channels: a token for 4) before
    # a decoder of experts
    "llama4": dict(
        text_config=dict(
            model_type="llama4_text",
            **TEXT,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size_mlp=128,
            attention_chunk_size=8,
        ),
        vision_config=dict(
            model_type="llama4_vision_model",
            **FIXED_SIZE_VISION | dict(intermediate_size=128, num_hidden_layers=2),
            image_size=56,
            vision_output_dim=64,
            projector_input_dim=64,
            projector_output_dim=64,
            pixel_shuffle_ratio=0.5,
        ),
        image_token_index=IMAGE,
    ),
    # Pixtral's tower (2D rotary positions, images of any size: `image_sizes`), a patch-merging projector
    "mistral3": dict(
        text_config=dict(model_type="mistral", **TEXT),
        vision_config=dict(model_type="pixtral", **FIXED_SIZE_VISION, image_size=56, head_dim=16),
        image_token_index=IMAGE,
        spatial_merge_size=2,
    ),
}
SEQ = 24


def image_text_model(hf_config: dict, seed: int):
    """transformers' image-text model with fresh random weights (norms around 1, the rest around 0), in eval mode."""
    config = transformers.AutoConfig.for_model(**hf_config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            normish = param.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight")
            param.normal_(1.0, 0.2) if normish else param.normal_(0.0, 0.15)
    return model.eval()


def qwen_rows(rows: int, generator: torch.Generator, token_types: bool, video_patches: int = 2) -> tuple:
    """(input_ids, megatrain's labels, each row's processor outputs): rows with an image of a few patches' grid at a
    random place, or a video clip of `video_patches` temporal patches (none: no video), or none; the tokens after
    each are trained."""
    patch = 3 * QWEN_VISION["temporal_patch_size"] * QWEN_VISION["patch_size"] ** 2
    ids = torch.randint(3, IMAGE, (rows, SEQ), generator=generator)
    media = []
    for row in range(rows):
        kind = row % 3 if video_patches or row % 3 != 1 else 0
        if kind == 2:  # (text alone)
            media.append({})
            continue
        t, h, w = (1, 4, 6) if kind == 0 else (video_patches, 4, 4)
        tokens = t * h * w // 4
        start = int(torch.randint(0, SEQ - tokens - 3, (), generator=generator))
        ids[row, start] = START
        ids[row, start + 1 : start + 1 + tokens] = IMAGE if kind == 0 else VIDEO
        ids[row, start + 1 + tokens] = END
        pixels = torch.randn(t * h * w, patch, generator=generator)
        grid = torch.tensor([[t, h, w]])
        media.append({"pixel_values": pixels, "image_grid_thw": grid} if kind == 0 else
                     {"pixel_values_videos": pixels, "video_grid_thw": grid})  # fmt: skip
    if token_types:
        for row, pixels in enumerate(media):  # (the processor's: 1 at image tokens, 2 at video tokens; every row)
            types = (ids[row : row + 1] == IMAGE).int() + 2 * (ids[row : row + 1] == VIDEO).int()
            media[row] = {**pixels, "mm_token_type_ids": types}
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[(labels >= IMAGE) | (torch.rand(rows, SEQ, generator=generator) < 0.2)] = -100
    return ids, labels, media


def fixed_size_rows(family: str, rows: int, generator: torch.Generator) -> tuple:
    """As `qwen_rows`, for towers of fixed-size images ([1, 3, size, size] pixels, 4 tokens each): rows with one or
    two images, or none; Gemma 3's token types (1 at image tokens) for every row."""
    size = FAMILIES[family]["vision_config"]["image_size"]
    ids = torch.randint(3, IMAGE, (rows, SEQ), generator=generator)
    media = []
    for row in range(rows):
        n_images = row % 3
        for image in range(n_images):
            ids[row, 2 + 8 * image : 6 + 8 * image] = IMAGE
        pixels = {"pixel_values": torch.randn(n_images, 3, size, size, generator=generator)} if n_images else {}
        if family == "mistral3" and n_images:
            pixels["image_sizes"] = torch.tensor([[size, size]] * n_images)
        if family == "gemma3":
            pixels["token_type_ids"] = (ids[row : row + 1] == IMAGE).long()
        media.append(pixels)
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[(labels >= IMAGE) | (torch.rand(rows, SEQ, generator=generator) < 0.2)] = -100
    return ids, labels, media


def tiled_rows(rows: int, generator: torch.Generator) -> tuple:
    """As `qwen_rows`, for LLaVA-NeXT: rows with an image of 28x28 (2 tiles, 10 tokens) or 28x56 pixels (3 tiles, 14
    tokens), or none."""
    ids = torch.randint(3, IMAGE, (rows, SEQ), generator=generator)
    media = []
    for row in range(rows):
        if row % 3 == 2:
            media.append({})
            continue
        (height, width), tiles, tokens = ((28, 28), 2, 10) if row % 3 == 0 else ((28, 56), 3, 14)
        ids[row, 3 : 3 + tokens] = IMAGE
        pixels = torch.randn(1, tiles, 3, 28, 28, generator=generator)
        media.append({"pixel_values": pixels, "image_sizes": torch.tensor([[height, width]])})
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    labels[(labels >= IMAGE) | (torch.rand(rows, SEQ, generator=generator) < 0.2)] = -100
    return ids, labels, media


def rows_of(family: str, rows: int, generator: torch.Generator) -> tuple:
    if family == "llava_next":
        return tiled_rows(rows, generator)
    if "temporal_patch_size" not in FAMILIES[family]["vision_config"]:
        return fixed_size_rows(family, rows, generator)
    # (Qwen3-VL and Qwen3.5 place a video's temporal patches apart, their times between them: a clip of one for
    # Qwen3-VL, none for Qwen3.5)
    video_patches = {"qwen2_5_vl": 2, "qwen3_vl": 1}.get(family, 0)
    return qwen_rows(rows, generator, takes_token_types(family), video_patches)


@functools.cache
def takes_token_types(family: str) -> bool:
    """Whether the installed transformers' model takes `mm_token_type_ids` (5.24's Qwen models place their 3-D
    rotary positions by them), so that the processor makes them."""
    config = transformers.AutoConfig.for_model(model_type=family, **FAMILIES[family])
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(config)
    return "mm_token_type_ids" in inspect.signature(type(model.base_model).forward).parameters


def batch_inputs(media: list[dict]) -> dict:
    """The whole batch's processor outputs, as transformers' model takes them (LLaVA-NeXT's tiles padded to the
    most an image has, as its processor pads them)."""
    return Media.of_rows(None, media).tensors


def trainer_of(
    hf_dir, tmp_path, grad_clip: float, steps: int, frozen=(), device="cpu", engine=EngineSection(), exact=False
) -> Trainer:
    """megatrain's trainer of the tiny model in `hf_dir`; `exact`: in float64 with AdamW's epsilon 1e-3
    (`hf_steps.exact_reference`: linear attention's fp32 noise otherwise flips AdamW's first, sign-like update)."""
    train = TrainSection(
        eps=1e-3 if exact else TrainSection.eps,
        freeze_vision_tower="vision_tower" in frozen,
        freeze_multi_modal_projector="multi_modal_projector" in frozen,
        freeze_language_model="language_model" in frozen,
        steps=steps,
        batch_size=6,
        micro_batch_size=2,
        lr=1e-4,
        weight_decay=0.1,
        grad_clip=grad_clip,
        warmup_steps=1,
        schedule="cosine",
    )
    config = Config(
        model=ModelSection(hf_dir=str(hf_dir), image_text=True),  # (Gemma 3's text model alone is its default)
        data=DataSection(seq_len=SEQ),
        train=train,
        precision=PrecisionSection("float64" if exact else "float32"),
        device=device,
        engine=engine,
        output_dir=str(tmp_path / "run"),
    )
    return Trainer(config)


def reference_step(model, optimizer, train, step, grad_clip, ids, labels, media):
    schedule = Schedule(train.lr, train.steps, train.warmup_steps, train.schedule, train.min_lr_ratio)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, schedule)
    optimizer.zero_grad()
    loss, _ = hf_forward(model, ids, media, labels)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip or float("inf"))
    optimizer.step()
    return loss, norm


def hf_forward(model, ids, media, labels=None) -> tuple:
    """(loss or None, logits) of transformers' model on the batch."""
    with language_model_output_fixed():
        out = model(input_ids=ids, labels=None if labels is None else hf_labels(labels), **batch_inputs(media))
    return out.loss, out.logits


@contextlib.contextmanager
def language_model_output_fixed():
    """transformers 5.24's Llama 4 image-text forward reads `image_outputs` from its language model's output, which
    has none (an upstream bug: the forward fails after computing everything): the attribute reads None meanwhile."""
    output = transformers.modeling_outputs.MoeCausalLMOutputWithPast
    patched = not hasattr(output, "image_outputs")
    if patched:
        output.image_outputs = None
    try:
        yield
    finally:
        if patched:
            del output.image_outputs


@pytest.mark.parametrize("grad_clip", [0.5, 0.0], ids=["clipped", "eager"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_steps_match_transformers(family, grad_clip, tmp_path):
    check_trains_like_transformers(family, grad_clip, tmp_path)


def test_stages_updated_on_the_gpu_reach_the_tied_table(tmp_path):
    """The first stages' state updated where they run (engine.gpu_updated_layers: the tower, the connector with
    the token table) takes Gemma 3's tied head with them, and trains like transformers."""
    check_trains_like_transformers("gemma3", 0.5, tmp_path, engine=EngineSection(gpu_updated_layers=4))


@pytest.mark.parametrize(
    "family, frozen",
    [
        ("qwen2_5_vl", ("vision_tower",)),
        ("qwen2_5_vl", ("multi_modal_projector",)),
        ("qwen2_5_vl", ("language_model",)),
        ("qwen2_5_vl", ("vision_tower", "language_model")),
        ("qwen3_vl", ("vision_tower",)),  # (its deepstack mergers with it, as LLaMA-Factory counts them)
        ("qwen3_vl", ("language_model",)),  # (the deepstack features' gradients through the frozen layers)
    ],
)
def test_frozen_parts_keep_no_state_and_train_the_rest_like_transformers(family, frozen, tmp_path):
    check_trains_like_transformers(family, 0.5, tmp_path, frozen=frozen)


# (Inductor compiles the layers that run through transformers' modules for tens of seconds a family: these
# compile, the rest run eagerly)
COMPILED_ON_GPU = ("qwen2_5_vl", "llava")


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(FAMILIES))
def test_gpu_steps_match_transformers(family, tmp_path):
    """The CUDA engine in fp32 (TF32 off), the tower's stages streamed like the decoder's, against transformers on
    the CPU."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    check_trains_like_transformers(
        family, 0.5, tmp_path, "cuda", engine=EngineSection(compile=family in COMPILED_ON_GPU)
    )


def check_trains_like_transformers(family, grad_clip, tmp_path, device="cpu", frozen=(), engine=EngineSection()):
    """Steps of megatrain equal transformers' + AdamW's; with linear attention both in float64, the delta rule token
    by token (`hf_steps.exact_reference`)."""
    exact = "linear_num_key_heads" in FAMILIES[family].get("text_config", {})
    with recurrences_token_by_token() if exact else contextlib.nullcontext():
        check_steps(family, grad_clip, tmp_path, device, frozen, engine, exact)


def check_steps(family, grad_clip, tmp_path, device, frozen, engine, exact) -> None:
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    reference = image_text_model({"model_type": family, **FAMILIES[family]}, seed)
    reference.save_pretrained(tmp_path / "hf")
    reference = reference.double() if exact else reference
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    trainer = trainer_of(tmp_path / "hf", tmp_path, grad_clip, 3, frozen, device, engine, exact)
    if engine.gpu_updated_layers != "auto":  # (the head tied to the table resident with it)
        assert len(trainer.spec.stages) - 1 in trainer.placement.resident
    assert trainer.model_config.image_text
    assert trainer.model_config.n_params == sum(p.numel() for p in reference.parameters())
    spec, store = trainer.spec, trainer.store
    frozen_groups = spec.frozen_groups(set(frozen))
    frozen_names = {p.name for g in frozen_groups for p in spec.groups[g].params}
    for name, param in reference.named_parameters():
        param.requires_grad_(name not in frozen_names)
    # a frozen group keeps no gradient and no optimizer state; the backward stops at the first stage that trains
    assert all(store.state_numel(g) == 0 and store.grad_numel(g) == 0 for g in frozen_groups)
    trained = sum(store.layouts[g].numel for g in range(store.n_groups) if g not in frozen_groups)
    assert store.arenas["state.exp_avg"].numel() < trained + 64 * store.n_groups
    first = next(i for i, s in enumerate(spec.stages) if any(g not in frozen_groups for g in s.groups))
    assert trainer.pipeline.first_backward == first
    train = trainer.config.train
    optimizer = adamw_decaying_matrices(reference, train)
    generator = torch.Generator().manual_seed(seed)
    noise_only = {}  # name -> elements whose gradient is zero in exact arithmetic (fp32 noise, AdamW scales it)
    for step in range(train.steps):
        ids, labels, media = rows_of(family, train.batch_size, generator)
        metrics = trainer.train_step(StepBatch(ids, labels, media=media))
        loss, norm = reference_step(reference, optimizer, train, step, grad_clip, ids, labels, media)
        assert metrics.loss == pytest.approx(loss.item(), rel=1e-5), step
        assert metrics.grad_norm == pytest.approx(norm.item(), rel=1e-4), step
        for name, p in reference.named_parameters():
            if p.grad is not None:  # (a key bias's gradient: softmax is blind to it)
                noise_only[name] = noise_only.get(name, False) | (p.grad.abs() < 1e-7 * norm)
    ids, _, media = rows_of(family, 3, generator)
    our_logits = trainer.logits(ids, media).cpu()
    exported = trainer.export(tmp_path / "out")
    trainer.close()
    reloaded = reload_export(exported, reference, transformers.AutoModelForImageTextToText)
    ours = dict(reloaded.named_parameters())
    for name, param in reference.named_parameters():
        signal = ~noise_only.get(name, torch.zeros_like(param, dtype=torch.bool))
        assert rel_err(ours[name].detach()[signal], param.detach()[signal]) < 1e-4, name
        if name in frozen_names:
            assert torch.equal(ours[name].detach().to(param.dtype), initial[name]), name
    with torch.no_grad():
        expected = hf_forward(reference, ids, media)[1]
        assert rel_err(hf_forward(reloaded, ids, media)[1], our_logits) < 1e-5
        assert rel_err(our_logits, expected) < 1e-4  # (as test_generic: the weights agree to 1e-4)


def test_the_plan_counts_frozen_parts_as_weights_only(tmp_path):
    """A frozen tower's parameters cost their fp32 master alone in the plan (no gradient, no moments), as the store
    allocates them, and the plan says so."""
    from megatrain.planning import engine_choices, step_shape
    from megatrain_plan import Machine, Planner, Rates, format_plan

    image_text_model({"model_type": "qwen2_5_vl", **FAMILIES["qwen2_5_vl"]}, 0).save_pretrained(tmp_path / "hf")
    plans = {}
    for frozen in ((), ("vision_tower",)):
        trainer = trainer_of(tmp_path / "hf", tmp_path, 0.5, steps=1, frozen=frozen)
        config, machine = trainer.config, Machine(gpu_memory=80 * 2**30, host_memory=None)
        planner = Planner(trainer.spec, Rates(), machine, step_shape(config), engine_choices(config))
        plans[frozen] = planner.plan(trainer.placement)
        tower = sum(trainer.store.layouts[g].numel for g in trainer.spec.frozen_groups({"vision_tower"}))
        trainer.close()
    whole, frozen = plans[()], plans[("vision_tower",)]
    assert whole.host_bytes - frozen.host_bytes == tower * 12  # (gradient and two moments, fp32 each)
    assert frozen.frozen_params == tower and frozen.frozen_parts == ("vision_tower",)
    assert "frozen parameters (vision_tower) hold weights only" in format_plan(frozen, "tiny")


def test_a_resumed_run_with_a_frozen_tower_equals_one_run(tmp_path):
    """Checkpoints of an image-text model (a frozen tower's weights, no optimizer state for it) resume bit-exactly:
    two steps, a checkpoint, two more in a new trainer equal four steps in one."""
    from megatrain.checkpoint import resolve_resume, save_checkpoint

    image_text_model({"model_type": "qwen2_5_vl", **FAMILIES["qwen2_5_vl"]}, 1).save_pretrained(tmp_path / "hf")
    generator = torch.Generator().manual_seed(1)
    batches = [rows_of("qwen2_5_vl", 6, generator) for _ in range(4)]
    frozen = ("vision_tower",)
    whole = trainer_of(tmp_path / "hf", tmp_path / "whole", 0.5, steps=4, frozen=frozen)
    losses = [whole.train_step(StepBatch(ids, labels, media=media)).loss for ids, labels, media in batches]
    first = trainer_of(tmp_path / "hf", tmp_path / "first", 0.5, steps=4, frozen=frozen)
    for ids, labels, media in batches[:2]:
        first.train_step(StepBatch(ids, labels, media=media))
    saved = save_checkpoint(first.state_dict(), tmp_path / "checkpoints")
    first.close()
    resumed = trainer_of(tmp_path / "hf", tmp_path / "resumed", 0.5, steps=4, frozen=frozen)
    resumed.load_state_dict(resolve_resume(saved).state())
    assert [
        resumed.train_step(StepBatch(ids, labels, media=media)).loss for ids, labels, media in batches[2:]
    ] == losses[2:]
    ours, theirs = resumed.named_weights(), whole.named_weights()
    assert all(torch.equal(ours[name], theirs[name]) for name in theirs)
    whole.close()
    resumed.close()


@pytest.mark.gpu
def test_gpu_vision_attention_in_one_varlen_call_equals_a_call_per_window(monkeypatch):
    """On the GPU in bf16 the tower's windowed and full attention run as one varlen flash call per block: its output
    and gradients equal transformers' call per window (SDPA) within bf16 rounding."""
    from megatrain_templates import Media
    from megatrain_zoo import image_text
    from megatrain_zoo.generic import generic_model_config
    from megatrain_zoo.model import build_model

    spec = build_model(generic_model_config({"model_type": "qwen2_5_vl", **FAMILIES["qwen2_5_vl"]}, image_text=True))
    ids, _, media = rows_of("qwen2_5_vl", 6, torch.Generator().manual_seed(0))
    media = Media.of_rows(ids, media).to("cuda")
    patches = media.tensors["pixel_values"].shape[0] + media.tensors["pixel_values_videos"].shape[0]
    assert image_text._varlen_attention_registered()  # (torch has the kernel; the attention is registered)
    results = []
    for varlen in (True, False):
        monkeypatch.setattr(image_text, "_varlen_attention_registered", lambda varlen=varlen: varlen)
        for index in (0, 1):  # (a windowed block, a full-attention one)
            block = spec.stages[1 + index].template
            generator = torch.Generator(device="cuda").manual_seed(index)
            weights = [(torch.randn(block.numel, device="cuda", generator=generator) * 0.1).bfloat16()]
            width = block.skeleton.width
            x = torch.randn(patches, width, device="cuda", generator=generator).bfloat16()
            grads = [torch.zeros(block.numel, device="cuda")]
            out = block.forward(weights, x, media=media)
            grad_x = block.backward(weights, x, torch.ones_like(out), grads, media=media)
            results.append((out.float(), grad_x.float(), grads[0]))
    for fast, own in zip(results[:2], results[2:]):
        for a, b in zip(fast, own):
            assert rel_err(a, b) < 2e-2


def test_a_text_model_that_cannot_train_alone_is_refused_in_one_line():
    """Qwen2.5-VL's text model alone (no native template reads it): one line, naming the fix."""
    from megatrain_zoo import ZooError, model_config_from_hf

    with pytest.raises(ZooError, match="cannot train alone.*model.image_text: auto") as refused:
        model_config_from_hf({"model_type": "qwen2_5_vl", **FAMILIES["qwen2_5_vl"]}, image_text=False)
    assert "\n" not in str(refused.value)


def test_a_tower_whose_convolutions_shrink_its_patches_is_probed_with_its_own_token_count():
    """GOT-OCR2's tower makes 256 tokens of an image's 4,096 patches: the trace's probe image gets as many image
    tokens as the model's own get_image_features makes (a count of patches was refused: 4096 tokens, 256 features)."""
    vision = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, window_size=4)
    hf = {"model_type": "got_ocr2", "image_token_index": IMAGE, "vision_config": vision, "text_config": TEXT}
    config = model_config_from_hf(hf)
    assert config.image_text and config.implementation == "transformers"
