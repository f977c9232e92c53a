"""The training configuration: frozen dataclasses loaded from YAML plus `key=value` overrides.

Every key is checked: an unknown or mistyped key is an error that names it and lists
the keys that section accepts."""

import copy
import os
import re
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import torch
import yaml

from megatrain_data import DataSection, not_utf8_where
from megatrain_optim import Schedule
from megatrain_store.rundir import absolute_paths
from megatrain_templates import ALL_LINEAR, REFERENCE_FREE_LOSSES, Lora
from megatrain_zoo import ModelConfig, config_to_hf, model_config_from_hf, preset, read_hf_config, read_peft_config

from .config_values import (
    COMMA_SEPARATED,
    ConfigError,
    UniqueKeyLoader,
    build_section,
    check_override_text,
    flat_keys,
    set_path,
)

BASE_DTYPES = ("nf4", "int8", "bfloat16", "float32")  # model.adapter.base_dtype: packed, or the compute dtype's


@dataclass(frozen=True)
class AdapterSection:
    """model.adapter: LoRA adapters trained over the frozen model (`type: lora`), with PEFT's names and meanings.
    `path`: a PEFT adapter directory to start from, whose adapter_config.json then gives r, alpha, dropout and
    target_modules."""

    type: str | None = None  # lora; null: no adapter, every parameter trains
    r: int = 16
    alpha: float = 32.0  # the adapters' delta is scaled by alpha / r (PEFT's lora_alpha)
    dropout: float = 0.0  # PEFT's lora_dropout: on the adapters' input, in training steps only
    # module names (q_proj, ..., down_proj) a matrix's module path ends with, or all-linear: every linear layer of
    # the decoder's layers
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    path: str | None = None
    # how the frozen base is held: null (or the compute dtype's name) in the compute dtype, 2 B/param in bf16; nf4
    # (QLoRA's 4-bit NF4 with double quantization, ~0.52 B/param) or int8 (row-wise, ~1 B/param) for its decoder
    # layers, quantized once as the run starts and dequantized on the GPU as each layer streams in
    base_dtype: str | None = None

    def __post_init__(self):
        if self.type not in (None, "lora"):
            raise ConfigError(f"model.adapter.type must be lora (or null: no adapter), got {self.type!r}")
        if self.type is None:
            given = [f.name for f in fields(self) if f.name != "type" and getattr(self, f.name) != f.default]
            if given:
                raise ConfigError(
                    f"model.adapter.{', model.adapter.'.join(given)} set without model.adapter.type: set "
                    "model.adapter.type=lora to train adapters, or leave them out"
                )
            return
        if self.r <= 0:
            raise ConfigError(f"model.adapter.r must be a positive rank, got {self.r}")
        if not self.alpha > 0:
            raise ConfigError(f"model.adapter.alpha must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.adapter.dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ConfigError("model.adapter.target_modules is empty: name modules (q_proj, v_proj, ...) or all-linear")
        if self.base_dtype not in (None, *BASE_DTYPES):
            raise ConfigError(
                f"model.adapter.base_dtype must be one of {BASE_DTYPES} (or null), got {self.base_dtype!r}"
            )


@dataclass(frozen=True)
class ModelSection:
    preset: str | None = None  # a megatrain_zoo preset name
    hf_dir: str | None = None  # a Hugging Face directory: config.json + safetensors (initial weights)
    # native: megatrain's own templates (fast); transformers: the family's transformers layers, called with the
    # streamed weights (any decoder transformers knows); auto: native where megatrain has the family, else transformers
    implementation: str = "auto"
    # an image-text checkpoint: true trains the whole model (its vision tower and projector streamed as stages before
    # the decoder's), false its text model alone; auto: whole unless megatrain has a native template for its text
    # model (Gemma 3, Llama 4, Mistral 3, Qwen3.5: their text model alone, at native speed)
    image_text: str | bool = "auto"
    adapter: AdapterSection = field(default_factory=AdapterSection)

    def __post_init__(self):
        if (self.preset is None) == (self.hf_dir is None):
            raise ConfigError(
                "set exactly one of model.preset (a preset name) or model.hf_dir (a Hugging Face directory)"
            )
        if self.implementation not in ("auto", "native", "transformers"):
            raise ConfigError(f"model.implementation must be auto, native or transformers, got {self.implementation!r}")
        if self.image_text not in ("auto", True, False):
            raise ConfigError(f"model.image_text must be auto, true or false, got {self.image_text!r}")


OBJECTIVES = ("sft", "dpo", "grpo")
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo", "orpo")
REPORT_TO = ("tensorboard", "wandb", "mlflow")


@dataclass(frozen=True)
class DPOSection:
    """train.objective: dpo. Names as TRL's DPOConfig (and CPOConfig's simpo_gamma); loss_type picks the loss:
    sigmoid (DPO; with label_smoothing, cDPO), ipo, hinge, robust, and the reference-free simpo and orpo."""

    beta: float = 0.1  # the inverse temperature of the implicit reward (ORPO: the odds-ratio term's weight)
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0  # cDPO's (sigmoid) and the robust loss's rate of flipped preferences
    reference_free: bool = False  # a reference that assigns every sequence the same log-probability
    ref_model: str | None = None  # a Hugging Face directory; None: the policy's initial weights
    simpo_gamma: float = 0.5  # SimPO's target reward margin
    # prompt tokens kept (its last ones) before the completions are cut to data.seq_len; None: data.seq_len // 2
    max_prompt_length: int | None = None

    def __post_init__(self):
        if self.loss_type not in DPO_LOSS_TYPES:
            raise ConfigError(f"train.dpo.loss_type must be one of {', '.join(DPO_LOSS_TYPES)}, got {self.loss_type!r}")
        if not self.beta > 0:
            raise ConfigError(f"train.dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"train.dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss_type not in ("sigmoid", "robust"):
            raise ConfigError(
                f"train.dpo.label_smoothing applies to the sigmoid and robust losses, not {self.loss_type}; set it to 0"
            )
        if self.max_prompt_length is not None and self.max_prompt_length < 1:
            raise ConfigError(f"train.dpo.max_prompt_length must be >= 1 or null, got {self.max_prompt_length}")

    @property
    def needs_reference(self) -> bool:
        return not self.reference_free and self.loss_type not in REFERENCE_FREE_LOSSES


@dataclass(frozen=True)
class GRPOSection:
    """train.objective: grpo. Names as TRL's GRPOConfig. A step's train.batch_size rows are
    batch_size / num_generations prompts with num_generations completions each, generated from the current weights
    or read from `rollouts`."""

    num_generations: int = 8  # completions per prompt: a group, whose rewards set each one's advantage
    beta: float = 0.0  # the KL penalty's weight (0: no reference model)
    use_bias_correction_kl: bool = True  # the KL term times the importance ratio (TRL's default since 1.10)
    epsilon: float = 0.2  # the importance ratio's clip below (and above, unless epsilon_high)
    epsilon_high: float | None = None  # DAPO's clip above (0.28); None: epsilon
    loss_type: str = "dapo"  # grpo, bnpo, dr_grpo or dapo: how the tokens' losses are averaged
    importance_sampling_level: str = "token"  # token (GRPO) or sequence (GSPO)
    scale_rewards: str = "group"  # group, batch or none (Dr. GRPO): what divides the advantages
    num_iterations: int = 1  # updates per batch of rollouts (the first's policy is the "old" one after)
    max_prompt_length: int = 512  # prompt tokens kept (the last ones)
    max_completion_length: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    repetition_penalty: float = 1.0  # transformers' (1: none), before the temperature, as TRL's
    # module:function (f(prompts, completions, **columns) -> list[float], TRL's signature) or a built-in name:
    # exact_match, numeric_answer (a math answer's number against `answer`), format:REGEX
    reward_funcs: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] | None = None  # None: 1 each
    rollouts: str | None = None  # a JSONL of completions to train on (prompt, completion, reward or advantage)
    ref_model: str | None = None  # the KL's reference: a Hugging Face directory; None: the initial weights
    log_completions_every: int = 10  # steps between samples written to completions.jsonl (0: never)
    # generation's weights on the GPU: resident (where they fit beside a KV cache), streamed layer by layer, or
    # auto (resident where they fit); its decoding step eager, or compiled over a static KV cache where the weights
    # are resident on a GPU (the first rollout compiles); megatrain's own options, not TRL's
    generation_weights: str = "auto"
    generation_decoding: str = "compiled"

    def __post_init__(self):
        if self.rollouts is not None and not self.rollouts.strip():
            raise ConfigError("train.grpo.rollouts is empty: name a JSONL of completions, or leave it out")
        object.__setattr__(self, "reward_funcs", tuple(self.reward_funcs))
        if self.reward_weights is not None:
            object.__setattr__(self, "reward_weights", tuple(float(w) for w in self.reward_weights))
            if len(self.reward_weights) != len(self.reward_funcs):
                raise ConfigError(
                    f"train.grpo.reward_weights has {len(self.reward_weights)} weights for "
                    f"{len(self.reward_funcs)} reward_funcs; give one each, or none"
                )
        choices = {
            "loss_type": GRPO_LOSS_TYPES,
            "importance_sampling_level": ("token", "sequence"),
            "scale_rewards": ("group", "batch", "none"),
            "generation_weights": ("auto", "resident", "streamed"),
            "generation_decoding": ("eager", "compiled"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"train.grpo.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("num_generations", "num_iterations", "max_prompt_length", "max_completion_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.grpo.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_generations < 2:  # (TRL's rule too)
            raise ConfigError("train.grpo.num_generations must be >= 2: a group of one has no advantage to learn from")
        if self.log_completions_every < 0:  # (taken, it logged every step)
            raise ConfigError(
                f"train.grpo.log_completions_every must be >= 0 (0: never), got {self.log_completions_every}"
            )
        for name in ("beta", "epsilon", "epsilon_high", "top_k"):
            if not (getattr(self, name) or 0) >= 0:  # (epsilon_high None: epsilon's)
                raise ConfigError(f"train.grpo.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("temperature", "repetition_penalty"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"train.grpo.{name} must be > 0, got {getattr(self, name)}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"train.grpo.top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class TrainSection:
    # the settings of the learning rate's schedule, in the order of `megatrain_optim.Schedule`'s fields
    SCHEDULE_KEYS: ClassVar = ("lr", "steps", "warmup_steps", "schedule", "min_lr_ratio", "decay_steps", "decay_shape")
    steps: int = 100
    batch_size: int = 8  # sequences per optimizer step (train.objective dpo: pairs)
    micro_batch_size: int | None = None  # sequences per forward/backward pass (dpo: pairs); None: batch_size
    # sft: next-token cross-entropy on the trained tokens; dpo: preference pairs (train.dpo.*, data.format preference);
    # grpo: online RL on prompts (train.grpo.*, data.format prompt); module:Class: a megatrain_templates objective
    objective: str = "sft"
    dpo: DPOSection = field(default_factory=DPOSection)
    grpo: GRPOSection = field(default_factory=GRPOSection)
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm; 0 = off
    warmup_steps: int = 0
    schedule: str = "cosine"  # constant | cosine | linear | wsd (warmup-stable-decay)
    min_lr_ratio: float = 0.1
    decay_steps: int = 0  # wsd: the last steps, which decay
    decay_shape: str = "cosine"  # wsd: cosine | linear | 1-sqrt
    seed: int = 0
    max_bad_steps: int = 3  # consecutive non-finite steps that stop the run
    # MoE routers with a correction bias (DeepSeek-V3, GLM-4.5, MiniMax-M2, dots.llm1, ERNIE 4.5): moved by this
    # much per step against each expert's excess load of the step in its layer (DeepSeek-V3's aux-loss-free
    # balancing, 0.001 in its pre-training; Megatron's moe_router_bias_update_rate); 0 keeps the bias as loaded
    router_bias_update_rate: float = 0.0
    # MoE: DeepSeek-V3's complementary sequence-wise balance loss, its weight (alpha; 0.0001 in DeepSeek-V3's
    # pre-training): the sum over MoE layers of the mean over sequences of sum_e f_e P_e (Megatron's seq_aux_loss)
    router_seq_aux_loss_coef: float = 0.0
    # MoE: ST-MoE's router z-loss, its weight (OLMoE pre-trained with 0.001): the sum over MoE layers of the
    # mean over tokens of logsumexp(router logits)^2 (Megatron's moe_z_loss_coeff)
    router_z_loss_coef: float = 0.0
    # an image-text model trained whole: which parts keep their weights (no gradient, no optimizer state, no backward
    # where nothing before them trains), as LLaMA-Factory names them and with its defaults
    freeze_vision_tower: bool = True
    freeze_multi_modal_projector: bool = False
    freeze_language_model: bool = False
    save_every: int = 0  # steps between checkpoints (0: only on SIGINT/SIGTERM)
    keep_last: int = 2  # checkpoints kept in output_dir/checkpoints
    eval_every: int = 0  # steps between validation losses (0: only after the last step); needs data.validation
    loss_plot: bool = True  # output_dir/loss.png after the last step (matplotlib: megatrain's [plot] extra)
    # experiment trackers that get every metrics.jsonl record and the config: any of REPORT_TO, as a list or
    # comma-separated (HF Trainer's report_to); none: metrics.jsonl only
    report_to: str | None = None
    tensorboard: bool = False  # the same as naming tensorboard in report_to (kept for older configs)

    def __post_init__(self):
        if self.micro_batch_size is None:
            object.__setattr__(self, "micro_batch_size", self.batch_size)
        elif self.micro_batch_size < 1:  # (0 once meant "batch_size"; taken silently, it hid a typo)
            raise ConfigError(
                f"train.micro_batch_size must be >= 1, got {self.micro_batch_size}; leave it out (or null) for "
                "train.batch_size"
            )
        object.__setattr__(self, "betas", tuple(self.betas))
        for name in ("steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.micro_batch_size:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.micro_batch_size "
                f"({self.micro_batch_size}); e.g. set micro_batch_size to a divisor of {self.batch_size}"
            )
        self._check_ranges()
        if self.objective == "grpo" and self.batch_size % self.grpo.num_generations:
            raise ConfigError(
                f"train.batch_size {self.batch_size} (completions per step) must be a multiple of "
                f"train.grpo.num_generations {self.grpo.num_generations}: a step holds whole groups"
            )
        if self.objective not in OBJECTIVES and not re.fullmatch(r"[\w.]+:[\w.]+", self.objective):
            raise ConfigError(
                f"train.objective must be one of {', '.join(OBJECTIVES)} or module:Class (a SequenceObjective of "
                f"your own, docs/guide.md), got {self.objective!r}"
            )
        unknown = sorted(set(self.trackers) - set(REPORT_TO))
        if unknown:
            raise ConfigError(f"train.report_to names {unknown}; it takes any of {list(REPORT_TO)} (or none)")
        # (Schedule checks its settings: an OptimError, which `build_section` gives as a ConfigError)
        object.__setattr__(self, "lr_schedule", Schedule(*(getattr(self, key) for key in self.SCHEDULE_KEYS)))
        if self.grad_clip < 0:
            raise ConfigError(f"train.grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        if not self.router_bias_update_rate >= 0:
            raise ConfigError(f"train.router_bias_update_rate must be >= 0, got {self.router_bias_update_rate}")
        for name in ("router_seq_aux_loss_coef", "router_z_loss_coef"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"train.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def rows_per_example(self) -> int:
        """Rows (sequences) an example of batch_size is: a preference pair's two for dpo, else one."""
        return 2 if self.objective == "dpo" else 1

    @property
    def rows_per_step(self) -> int:
        return self.batch_size * self.rows_per_example

    @property
    def frozen_parts(self) -> set[str]:
        """The parts of an image-text model the freeze_* options name (`ModelSpec.group_parts`)."""
        names = ("vision_tower", "multi_modal_projector", "language_model")
        return {name for name in names if getattr(self, f"freeze_{name}")}

    @property
    def rows_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.rows_per_example

    def _check_ranges(self) -> None:
        """Values outside their range fail here rather than being taken silently (keep_last 0 kept every
        checkpoint, save_every -1 saved every step) or deep in a step (seed -1)."""
        limits = {  # field: (lowest allowed, what it means)
            "warmup_steps": (0, "0: no warmup"),
            "seed": (0, "the random seed of the weights, the data order and LoRA dropout's masks"),
            "save_every": (0, "0: only on SIGINT/SIGTERM"),
            "keep_last": (1, "the newest N checkpoints are kept"),
            "eval_every": (0, "0: only after the last step"),
            "max_bad_steps": (1, "non-finite steps in a row that stop the run"),
            "lr": (0, "the peak learning rate"),
            "weight_decay": (0, "0: none"),
        }
        for name, (lowest, meaning) in limits.items():
            if not getattr(self, name) >= lowest:
                raise ConfigError(f"train.{name} must be >= {lowest} ({meaning}), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ConfigError(f"train.eps must be > 0 (AdamW's denominator term, e.g. 1e-8), got {self.eps}")
        if self.lr * self.weight_decay >= 1:  # (each step scales the weights by 1 - lr x weight_decay: 0 or below)
            raise ConfigError(f"train.lr x train.weight_decay must be < 1, got {self.lr} x {self.weight_decay}")
        if len(self.betas) != 2 or not all(0 <= beta < 1 for beta in self.betas):
            raise ConfigError(f"train.betas must be two numbers in [0, 1), e.g. [0.9, 0.95], got {list(self.betas)}")

    @property
    def trackers(self) -> tuple[str, ...]:
        """The experiment trackers to log to: report_to's names, and tensorboard where `tensorboard: true`."""
        names = [n.strip() for n in (self.report_to or "").split(",") if n.strip() and n.strip() != "none"]
        if self.tensorboard and "tensorboard" not in names:
            names.insert(0, "tensorboard")
        return tuple(names)


@dataclass(frozen=True)
class PrecisionSection:
    # float32 | bfloat16 | auto (bfloat16 on a GPU, float32 on the CPU); float64 is for exactness tests
    compute_dtype: str = "auto"

    def __post_init__(self):
        if self.compute_dtype not in ("auto", "float32", "bfloat16", "float64"):
            raise ConfigError(f"precision.compute_dtype must be float32, bfloat16 or auto, got {self.compute_dtype!r}")


@dataclass(frozen=True)
class EngineSection:
    """How the engine places the model. `placement: auto` lets the planner decide every layer's placement for each
    step size (`megatrain plan` prints it); the knobs below it override one choice of that plan each (auto: the
    planner's), and a placement file (`placement.json`, as a run writes into its output_dir) is executed as written."""

    # auto: planned for each step size; or a placement.json to execute as written
    placement: str = "auto"
    n_slots: int = 2  # device weight slots (2 = double buffering)
    # activation checkpoints in pinned host memory; "auto": when they would take over half the free GPU memory
    offload_checkpoints: bool | str = "auto"
    # layers (the last ones) whose forward keeps its matmul products for the backward, which then
    # recomputes no GEMM (only norms, rotary embedding, attention and activation); "auto": as many as
    # the GPU's free memory holds (none on the CPU)
    kept_layers: int | str = "auto"
    # more kept layers, before those, whose products wait in pinned host memory instead (copied out in the forward,
    # when PCIe carries no gradient, and back a layer ahead of their backward); "auto": at large steps (the GPU is the
    # bound), as many as 85% of host memory, with the rest of the run, and the forward's copy time allow, after the
    # offloaded checkpoints (the same GPU room per host byte, half the copies), where the CPU optimizer takes under
    # half the GPU's work (none on the CPU, nor for Llama-2-7B at 128k on a 128 GiB host, which the checkpoints fill)
    host_kept_layers: int | str = "auto"
    # layers (the first blocks) whose weights, copied in for the forward, stay on the GPU until their
    # backward, so each weight crosses PCIe and is read from host memory once a step instead of twice;
    # "auto": every block but the last, in up to a quarter of the GPU, where the CPU optimizer is slower
    # than the GPU's work (small steps; none on the CPU)
    held_layers: int | str = "auto"
    # blocks (the first ones; with any, the embedding too, and the head's norm where it is tied) whose fp32 master
    # weights and AdamW moments stay on the GPU, updated there (12 B/param of GPU memory; the store's copy is brought
    # up to date for checkpoints): their weights and gradients do not cross PCIe and the CPU optimizer has that much
    # less to do; "auto": where the CPU optimizer is slower than the GPU's work (small steps), enough to bring it
    # within 80% of that work, in up to three quarters of the GPU (one process per machine only; none on the CPU)
    gpu_updated_layers: int | str = "auto"
    # of those blocks, the first ones whose weights stay on the GPU in the compute dtype too (2 B/param in bf16),
    # refreshed by their update, instead of cast from the masters in each forward and backward; "auto": as many
    # as the GPU's room beside the step, its kept products and their extras holds
    copied_layers: int | str = "auto"
    # of those stages (the table first), the ones whose moments wait in pinned host memory from their update to the
    # next backward (8 B/param less GPU memory at the peak); "auto": the fewest giving the fastest predicted step
    parked_layers: int | str = "auto"
    # gradient landing buffers, in largest groups' gradients, where updates run as gradients land
    # (grad_clip 0); "auto": as the planner sizes it (deeper where the CPU optimizer lags the backward)
    gradient_pool: float | str = "auto"
    # forward-backward sweeps a step runs its micro-batches in, gradients summed over them before the one
    # update: each sweep keeps what a step of its size would (more layers' matmul products on the GPU), at
    # the price of the weights and the gradients' sums so far crossing PCIe once more a sweep; needs a landing
    # buffer per group (no gradient_pool) and the summed cross-entropy (sft); "auto": the planner's, more than
    # one where the GPU bounds a large step, it predicts them faster and their copies leave PCIe room
    sweeps: int | str = "auto"
    trace: bool = False  # write a Chrome trace of the last step to output_dir/trace.json
    # the disk tier: AdamW moments (8 B/param) in memory-mapped files in this directory instead of RAM
    optimizer_state_dir: str | None = None
    # share of the parameters (the last layers') whose moments go there; "auto": as few as the
    # run needs to fit in host memory
    disk_state_fraction: float | str = "auto"
    # keep a bf16 copy of the weights in host memory (+2 B/param) to halve host->GPU traffic: worth it
    # only where PCIe is the bound; where the CPU optimizer is (small dense steps) its refresh after every
    # update costs more than it saves (7B at 16k tokens: 231 against 324 model TFLOPS, held layers on)
    wire_copy: bool = False
    # several hosts (torchrun --nnodes > 1): split the master weights and AdamW moments over the hosts
    # instead of keeping a replica on each, so H hosts hold a model about H times larger (each keeps
    # a full bf16 copy of the weights to stream, 2 B/param, and receives the others' updates)
    shard_across_hosts: bool = False
    # a MoE layer's experts stream in parts of at most this many, a stage each, so a GPU slot holds a
    # part, not the layer; "auto": whole layers where they fit the GPU, else the fewest parts that do
    experts_per_stage: int | str = "auto"
    # the most host memory the run's plan may take, GiB; it can only lower what the operating system gives (the
    # cgroup's limit or MemAvailable, less a margin: `megatrain plan` says which); null: that. (The machine's own
    # limit is MEGATRAIN_HOST_MEMORY_GIB, which lowers it too.)
    host_memory_gib: float | None = None
    # compile the elementwise work between the GEMMs (norms, rotary embedding, the experts' activation), a packed
    # base's dequantization and the generic path's layers (transformers' own) with torch.compile on CUDA, one
    # kernel each way instead of five to ten, and a generic layer's kept graph holding its GEMMs' outputs alone; false:
    # eager (a first step without the compile's tens of seconds, a kernel to debug). The CPU always runs eagerly;
    # FlexAttention (packed documents) is compiled either way, its eager form being a slow reference.
    compile: bool = True
    # CPU threads of each process (the CPU optimizer's and the host side's); "auto": torch's default for a
    # process alone, less one core on a GPU (for the threads issuing its work), the host's cores split among its
    # processes under torchrun (whose OMP_NUM_THREADS=1 would leave the optimizer one core)
    cpu_threads: int | str = "auto"
    # several processes: how long a rank waits for another (a host's rank to update a layer, another host's
    # updated weights) before it concludes that one died or hung and stops the run; an update takes well under
    # a second per layer. MEGATRAIN_RANK_WAIT_S overrides it.
    rank_wait_s: float = 600.0
    # several processes: the memory-backed directory where a host's processes share the master weights and
    # optimizer state (~12 B/param on each host). MEGATRAIN_SHARED_DIR overrides it (a host whose /dev/shm is small).
    shared_dir: str = "/dev/shm"
    # measure this GPU's block and head rates at the run's shape the first time a shape is planned (seconds,
    # remembered in $MEGATRAIN_CACHE/calibration.json, the machine's cache); false: plan with the remembered or
    # default rates only. MEGATRAIN_MEASURE_RATES=0 or 1, where set, overrides this (the tests set 0)
    measure_rates: bool = True

    def __post_init__(self):
        gib = self.host_memory_gib
        if gib is not None and (isinstance(gib, (str, bool)) or not gib > 0):
            raise ConfigError(f"engine.host_memory_gib must be a number of GiB > 0 (or null), got {gib!r}")
        if self.offload_checkpoints not in (True, False, "auto"):
            raise ConfigError(
                f"engine.offload_checkpoints must be true, false or auto, got {self.offload_checkpoints!r}"
            )
        if self.n_slots < 2:
            raise ConfigError(f"engine.n_slots must be >= 2, got {self.n_slots}")
        if not isinstance(self.placement, str) or not self.placement:
            raise ConfigError(f"engine.placement must be auto or a placement.json file, got {self.placement!r}")
        pool = self.gradient_pool
        if pool != "auto" and (isinstance(pool, (str, bool)) or not pool >= 1):
            raise ConfigError(f"engine.gradient_pool must be auto or a number >= 1 (largest groups), got {pool!r}")
        for name in (name for name in self.__dataclass_fields__ if name.endswith("_layers")):
            layers = getattr(self, name)
            if layers != "auto" and (isinstance(layers, (str, bool)) or not isinstance(layers, int) or layers < 0):
                raise ConfigError(f"engine.{name} must be auto or an integer >= 0, got {layers!r}")
        fraction = self.disk_state_fraction
        if fraction != "auto" and (isinstance(fraction, (str, bool)) or not 0 <= fraction <= 1):
            raise ConfigError(f"engine.disk_state_fraction must be auto or a number in [0, 1], got {fraction!r}")
        state_dir = self.optimizer_state_dir
        if state_dir is not None and (not state_dir.strip() or Path(state_dir).is_file()):
            raise ConfigError(f"engine.optimizer_state_dir {state_dir!r} must name a directory (on a fast local disk)")
        if fraction != "auto" and fraction > 0 and not self.optimizer_state_dir:
            raise ConfigError(
                f"engine.disk_state_fraction {fraction} puts moments on disk, but engine.optimizer_state_dir names "
                "no directory for them; set it (a fast local disk), or leave the fraction out"
            )
        for name in ("experts_per_stage", "sweeps", "cpu_threads"):
            value = getattr(self, name)
            if value != "auto" and (isinstance(value, (str, bool)) or not isinstance(value, int) or value < 1):
                raise ConfigError(f"engine.{name} must be auto or an integer >= 1, got {value!r}")
        if self.cpu_threads != "auto" and self.cpu_threads > (os.cpu_count() or 1):
            raise ConfigError(
                f"engine.cpu_threads {self.cpu_threads} is more than this machine's {os.cpu_count()} cores; set auto "
                f"or at most {os.cpu_count()}"
            )
        if isinstance(self.rank_wait_s, (str, bool)) or not self.rank_wait_s > 0:
            raise ConfigError(f"engine.rank_wait_s must be a number of seconds > 0, got {self.rank_wait_s!r}")
        if not isinstance(self.shared_dir, str) or not self.shared_dir:
            raise ConfigError(f"engine.shared_dir must name a memory-backed directory, got {self.shared_dir!r}")


@dataclass(frozen=True)
class Config:
    model: ModelSection = field(default_factory=lambda: ModelSection(preset="small-llama"))
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    precision: PrecisionSection = field(default_factory=PrecisionSection)
    engine: EngineSection = field(default_factory=EngineSection)
    device: str = "auto"  # cpu | cuda | cuda:N | auto
    output_dir: str = "runs/default"
    # a directory on another disk: where a checkpoint goes when one to output_dir (or the final model) cannot be
    # written (its disk full), so the run's state is kept instead of lost
    fallback_dir: str | None = None

    def __post_init__(self):
        if self.train.objective == "dpo" and self.data.format == "text" and self.data.dataset is not None:
            # the objective says what the records are, as TRL's DPOTrainer reads prompt/chosen/rejected columns
            object.__setattr__(self, "data", replace(self.data, format="preference"))
        if self.data.format == "prompt" and self.train.objective != "grpo":
            raise ConfigError(  # (prompt-only records train nothing under sft or dpo: GRPO generates their completions)
                f"data.format prompt is GRPO's prompt-only data; set train.objective: grpo (or another data.format for "
                f"train.objective {self.train.objective})"
            )
        if self.train.eval_every and self.data.validation is None:
            raise ConfigError(
                "train.eval_every needs held-out data: set data.validation (a fraction, a file or a split)"
            )
        if not isinstance(self.output_dir, str) or not self.output_dir.strip():
            raise ConfigError(
                f"output_dir must name a directory for the run's metrics, checkpoints and model, got {self.output_dir!r}"
            )
        if not isinstance(self.device, str) or not (
            self.device in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", self.device)
        ):
            raise ConfigError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        fallback = self.fallback_dir
        if fallback is not None and (not fallback.strip() or Path(fallback).is_file() or fallback == self.output_dir):
            raise ConfigError(  # (found only when a save needs it: a full disk, the worst moment)
                f"fallback_dir {fallback!r} must name a directory on another disk than output_dir's (or be left out)"
            )
        max_prompt = self.train.dpo.max_prompt_length
        if self.train.objective == "dpo" and max_prompt is not None and max_prompt >= self.data.seq_len:
            raise ConfigError(
                f"train.dpo.max_prompt_length {max_prompt} leaves no room for a completion in data.seq_len "
                f"{self.data.seq_len}; set it below data.seq_len (or leave it out: seq_len // 2)"
            )
        if self.engine.sweeps not in ("auto", 1) and self.train.objective != "sft":
            raise ConfigError(
                f"engine.sweeps {self.engine.sweeps}: train.objective {self.train.objective} reads every micro-batch "
                "of a step before any backward; set engine.sweeps to 1 or auto"
            )

    def as_dict(self) -> dict:
        return asdict(self)


def config_from_dict(values: dict) -> Config:
    return build_section(Config, values, "")


def config_changes(base: dict | None, config: Config) -> list[str]:
    """`key old -> new` for each setting `config` has otherwise than `base` (values as `Config.as_dict` gives
    them: a resumed run's own config)."""
    if base is None:
        return []
    try:
        before = flat_keys(config_from_dict(base).as_dict())
    except ConfigError:  # (a config of another megatrain version: compared as written)
        before = flat_keys(base)
    return [
        f"{key} {before.get(key)!r} -> {value!r}"
        for key, value in flat_keys(config.as_dict()).items()
        if before.get(key) != value
    ]


def default_config_path() -> Path:
    """The built-in default job: `megatrain train` with no --config."""
    return Path(str(resources.files("megatrain") / "configs" / "default.yaml"))


# keys naming files or folders, made absolute for a run where they exist here (a hub dataset's name and `auto` stay
# as written); OUTPUT_PATH_KEYS always, made or not
PATH_KEYS = (
    "model.hf_dir",
    "data.tokens",
    "data.text",
    "data.dataset",
    "data.dataset_dir",
    "data.tokenizer",
    "data.chat_template",
    "data.validation",
    "train.dpo.ref_model",
    "train.grpo.ref_model",
    "train.grpo.rollouts",
    "engine.placement",
)
OUTPUT_PATH_KEYS = ("output_dir", "fallback_dir", "engine.optimizer_state_dir")


def with_absolute_paths(config: Config) -> Config:
    """`config` with its paths absolute (PATH_KEYS, OUTPUT_PATH_KEYS), so that a run's config.json, checkpoints and
    exports name the same files from any directory (a resumed run's `runs/default/final` typed elsewhere failed)."""
    values = config.as_dict()
    for key, value in flat_keys(values).items():
        if isinstance(value, str) and key in PATH_KEYS + OUTPUT_PATH_KEYS:
            joined = "," if key in COMMA_SEPARATED else None
            set_path(values, key, absolute_paths(value, joined, always=key in OUTPUT_PATH_KEYS))
    return config_from_dict(values)


def load_config(path: str | Path | None = None, overrides: list[str] = (), base: dict | None = None) -> Config:
    """Read a YAML config (or start from the defaults) and apply `key.sub=value` overrides. `base`: values
    as `Config.as_dict` gives them (a resumed run's own config); a section the file names replaces the base's
    whole, as the file is written (model.preset and model.hf_dir, data.tokens and data.text are alternatives),
    and each override then replaces one key (with its alternatives in `ALTERNATIVES`: model.hf_dir=DIR replaces the
    file's model.preset)."""
    values: dict = copy.deepcopy(base) if base is not None else {}
    if path is not None:
        try:
            loaded = yaml.load(Path(path).read_text(), Loader=UniqueKeyLoader) or {}
        except FileNotFoundError:
            raise ConfigError(f"config file {path} not found; check the path (no --config: the built-in job)") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a directory; name the YAML file in it") from None
        except UnicodeDecodeError:
            raise ConfigError(f"config file {not_utf8_where(path)}; save it as UTF-8") from None
        except OSError as error:
            raise ConfigError(f"config file {path} cannot be read ({error}); name a readable YAML file") from error
        except yaml.YAMLError as error:  # (at the line where the failing construct begins: an unclosed bracket's)
            mark = getattr(error, "context_mark", None) or getattr(error, "problem_mark", None)
            line = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config file {path}{line}: invalid YAML ({getattr(error, 'problem', error)})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must be a mapping of sections, got {type(loaded).__name__}")
        values.update(loaded)
    if not values and path is not None and base is None:
        raise ConfigError(
            f"config file {path} is empty (it sets nothing, so the run would be the built-in default); write its "
            "sections (model, data, train), or leave --config out to run the default job"
        )
    pairs = []
    for item in overrides:
        check_override_text(item)
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value, e.g. train.lr=1e-4")
        key, raw = item.split("=", 1)
        try:
            pairs.append((key.strip(), yaml.safe_load(raw)))
        except yaml.YAMLError:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML; close its brackets and quotes") from None
    for key in _alternatives_replaced(pairs):
        set_path(values, key, None)
    for key, value in pairs:
        set_path(values, key, value)
    config = config_from_dict(values)
    _check_objective_settings(config.train, values.get("train") or {}, (base or {}).get("train") or {})
    return config


def _check_objective_settings(train: TrainSection, given: dict, saved: dict) -> None:
    """Refuse train.dpo or train.grpo settings given for another objective, which reads none (a run that forgot
    train.objective: dpo trained SFT, unsaid): those of `given` (the config's values) other than `saved`'s (a resumed
    run's, which holds them all) or, where it holds none, than the defaults (a run's config.json given as --config
    holds them all too); GRPO's generation settings are any run's (`megatrain generate` reads them)."""
    for section in {"dpo", "grpo"} - {train.objective}:
        built, default, was = getattr(train, section), type(getattr(train, section))(), saved.get(section) or {}
        for name, value in (given.get(section) or {}).items():
            same = value == was[name] if name in was else getattr(built, name) == getattr(default, name)
            if not (value is None or same or name.startswith("generation_")):
                raise ConfigError(
                    f"train.{section}.{name} is set, but train.objective is {train.objective}, which reads no "
                    f"train.{section}: set train.objective: {section}, or leave train.{section} out"
                )


ALTERNATIVES = (("model.preset", "model.hf_dir"), ("data.tokens", "data.text", "data.dataset"))


def _alternatives_replaced(pairs: list[tuple[str, Any]]) -> list[str]:
    """The keys that `pairs` (overrides) replace by setting one of their alternatives, unless set themselves."""
    given = {key for key, value in pairs if value is not None}
    named = {key for key, _ in pairs}
    return [key for group in ALTERNATIVES if given & set(group) for key in group if key not in named]


def resolve_device(name: str) -> torch.device:
    """The torch device for `device:` (auto = cuda when there is one)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available; use device: cpu or auto")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype for `precision.compute_dtype` (auto = bf16 on a GPU, fp32 on the CPU)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[name]


def adapter_of(config: Config) -> Lora | None:
    """The LoRA adapter model.adapter configures (its PEFT directory's settings where it names one), or None."""
    section = config.model.adapter
    if section.type is None:
        return None
    if section.path is None:
        adapter = Lora(section.r, section.alpha, section.target_modules, section.dropout)
    else:
        adapter = read_peft_config(Path(section.path))
    adapter = replace(adapter, base_format=_base_format(config))
    if config.train.router_bias_update_rate:
        raise ConfigError(
            f"train.router_bias_update_rate {config.train.router_bias_update_rate} moves the frozen routers' "
            "correction biases, which LoRA leaves as they are; set it to 0 with model.adapter"
        )
    return adapter


def _base_format(config: Config) -> str | None:
    """How the store packs the frozen base (model.adapter.base_dtype nf4 or int8), or None: in the compute dtype,
    which a dtype's name there must then be."""
    base_dtype = config.model.adapter.base_dtype
    # (a run's device as named, not as available: a GPU run's checkpoint is converted or evaluated on any machine)
    device = resolve_device(config.device) if config.device == "auto" else torch.device(config.device)
    compute = resolve_dtype(config.precision.compute_dtype, device)
    if base_dtype in ("nf4", "int8"):
        if compute == torch.float64:
            raise ConfigError(
                f"model.adapter.base_dtype {base_dtype} dequantizes into float32 or bfloat16, not float64; set "
                "precision.compute_dtype to float32 or bfloat16"
            )
        return base_dtype
    if base_dtype is not None and getattr(torch, base_dtype) != compute:
        raise ConfigError(
            f"model.adapter.base_dtype {base_dtype} differs from the compute dtype {str(compute).removeprefix('torch.')}"
            f", which holds the unpacked base; set it to null (the compute dtype), nf4 or int8"
        )
    return None


def model_config_of(config: Config) -> ModelConfig:
    """The model a config names: a zoo preset or a Hugging Face directory's config.json."""
    if config.model.hf_dir is not None:
        return read_hf_config(Path(config.model.hf_dir), config.model.implementation, config.model.image_text)
    if config.model.implementation == "transformers":  # (a preset through transformers' modules: to compare paths)
        return model_config_from_hf(config_to_hf(preset(config.model.preset)), "transformers")
    return preset(config.model.preset)
