"""What a run's objective and model settings make: the step-level objective train.objective names, GRPO's reward
functions train.grpo.reward_funcs names (the config's names of the user's code resolved here), and the refusal of
settings the model cannot honour."""

import inspect

from megatrain_data.rewards import Rewards, import_user_module, reward_function
from megatrain_templates import DPO, GRPO, Objective
from megatrain_zoo import CORRECTION_BIASED, ModelConfig

from .config import Config, ConfigError


def check_model_settings(config: Config, model: ModelConfig) -> None:
    """Refuse options the model cannot honour (router options its routers lack, packed documents its layers would
    mix, image-text settings on a text model), naming the fix."""
    if config.data.pack and not model.packs_documents:
        raise ConfigError(
            f"data.pack: {model.arch}'s layers would mix a packed row's documents as transformers runs them (a "
            "recurrence or convolution carrying state along the row, or attention its forward does not keep apart "
            "where positions restart); set data.pack: false (a row per example)"
        )
    if config.train.router_bias_update_rate and not model.router_bias:
        raise ConfigError(
            f"train.router_bias_update_rate moves a router's correction bias, which only some families' routers "
            f"have ({', '.join(CORRECTION_BIASED)}); this {model.arch} model has none: set it "
            f"to 0 (its balance comes from the load-balancing loss, router_aux_loss_coef)"
        )
    if config.train.freeze_language_model and not model.image_text:
        raise ConfigError(
            f"train.freeze_language_model freezes an image-text model's decoder; this {model.arch} model is all "
            "language model (nothing else would train): set it to false, or train adapters (adapter.type: lora)"
        )
    vision = {
        "model.image_text: true": config.model.image_text is True,
        "train.freeze_vision_tower: false": not config.train.freeze_vision_tower,
        "train.freeze_multi_modal_projector: true": config.train.freeze_multi_modal_projector,
    }
    if any(vision.values()) and not model.image_text:
        given = [setting for setting, said in vision.items() if said]
        raise ConfigError(
            f"{', '.join(given)}: for an image-text model's vision tower and projector; this {model.arch} model is "
            f"all language model (it has neither): leave {'it' if len(given) == 1 else 'them'} out"
        )
    for name in ("router_seq_aux_loss_coef", "router_z_loss_coef"):
        if getattr(config.train, name) and not model.is_moe:  # (a generic model's routers are transformers')
            raise ConfigError(
                f"train.{name} acts on the routers of megatrain's mixture-of-experts templates; this {model.arch} "
                "model has none: set it to 0"
            )


def make_objective(config: Config) -> Objective | None:
    """The step-level objective train.objective names (None: the summed cross-entropy of SFT): DPO, GRPO, or a
    `module:Class` of the user's, a megatrain_templates Objective made with no arguments."""
    name = config.train.objective
    if name == "sft":
        return None
    if name == "dpo":
        dpo = config.train.dpo
        return DPO(dpo.beta, dpo.loss_type, dpo.label_smoothing, dpo.reference_free, dpo.simpo_gamma)
    if name == "grpo":
        g = config.train.grpo
        return GRPO(
            g.beta, g.epsilon, g.epsilon_high, g.loss_type, g.importance_sampling_level, g.max_completion_length,
            use_bias_correction_kl=g.use_bias_correction_kl,
        )  # fmt: skip
    return user_objective_class(name)()


def user_objective_class(name: str) -> type[Objective]:
    """The class a train.objective `module:Class` names, checked without making it (importable, a megatrain_templates
    Objective, made with no arguments: its signature read): the checks before the data is read call this, and the
    trainer makes it, once (its constructor may load what it scores with)."""
    module_name, _, class_name = name.partition(":")
    try:
        objective = getattr(import_user_module(module_name), class_name)
        inspect.signature(objective).bind()
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        raise ConfigError(
            f"train.objective {name!r} cannot be made: {error}; name an importable module:Class made with no arguments"
        ) from error
    if not (isinstance(objective, type) and issubclass(objective, Objective)):
        raise ConfigError(
            f"train.objective {name!r} is {objective!r}, not a megatrain_templates objective "
            "(a SequenceObjective or TokenObjective subclass)"
        )
    return objective


def make_rewards(config: Config) -> Rewards:
    """The weighted reward functions train.grpo.reward_funcs and reward_weights name."""
    names = config.train.grpo.reward_funcs
    if not names:
        raise ConfigError(
            "train.objective grpo needs train.grpo.reward_funcs: a built-in (exact_match, numeric_answer, "
            "format:REGEX) or module:function, or train.grpo.rollouts with given rewards"
        )
    return Rewards(names, [reward_function(name) for name in names], config.train.grpo.reward_weights)
