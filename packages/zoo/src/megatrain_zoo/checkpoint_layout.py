"""How a family's checkpoints name and lay out the weights transformers' modules hold (`megatrain_zoo.skeleton`):
transformers' own conversion mapping, both ways, a group of tensors at a time."""

import torch
from torch import Tensor

from .skeleton import GenericError, HFSkeleton


class CheckpointLayout:
    """How the family's checkpoints name and lay out the weights its modules hold: transformers' own conversion
    mapping (Phi-MoE's checkpoints hold an expert's matrices one tensor each, its modules all experts' in one),
    applied a group of tensors at a time (a layer's: no more than a layer in memory)."""

    def __init__(self, skeleton: HFSkeleton):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        self.skeleton = skeleton
        mapping = get_model_conversion_mapping(skeleton.model)
        self._renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
        self._converters = [m for m in mapping if isinstance(m, WeightConverter)]
        self._mapping = mapping
        # every name a parameter has (a tied LM head's too) -> the name it is stored under
        self._canonical = {
            name: skeleton.names[id(p)] for name, p in skeleton.model.named_parameters(remove_duplicate=False)
        }
        # persistent buffers, which megatrain's native stores may hold (DeepSeek-V3's routing bias)
        self.buffers = [name for name in skeleton.model.state_dict() if name not in self._canonical]
        self._buffer_names = set(self.buffers)

    def sources(self, present: list[str], where: str, buffers: bool = False) -> dict[str, list[str]]:
        """The model's parameter name -> the checkpoint tensors it is made from, for a checkpoint holding
        `present`; a tensor the model has no place for, or a parameter no tensor makes, is refused (`where`
        names the checkpoint). `buffers`: a tensor may also be a persistent buffer's (named as itself)."""
        return self._made(present, where, buffers)[0]

    def _made(self, present: list[str], where: str, buffers: bool) -> tuple[dict[str, list[str]], set[str]]:
        """`sources`, and the parameters a converter makes (not renaming alone)."""
        canonical = self._canonical | ({name: name for name in self.buffers} if buffers else {})
        from transformers.core_model_loading import rename_source_key

        meta = self.skeleton.model.state_dict()
        prefix = self.skeleton.model.base_model_prefix
        made: dict[str, list[str]] = {}
        converted: set[str] = set()
        for key in present:
            if key.endswith("rotary_emb.inv_freq"):
                continue
            renamed, source_pattern = rename_source_key(key, self._renamings, self._converters, prefix, meta)
            for target in self._split_targets(renamed, source_pattern):
                if target not in canonical:
                    raise GenericError(
                        f"{where}: unexpected tensor {key!r} (transformers' {type(self.skeleton.model).__name__} has "
                        "no place for it); the checkpoint does not belong to this config.json"
                    )
                made.setdefault(canonical[target], []).append(key)
                if source_pattern is not None:
                    converted.add(canonical[target])
        missing = [name for name in self.skeleton.names.values() if name not in made]
        if missing:
            raise GenericError(
                f"{where}: tensor(s) for {missing[:5]}{' ...' if len(missing) > 5 else ''} missing; the checkpoint "
                "is incomplete or for a different model"
            )
        return made, converted

    def _split_targets(self, target: str, source_pattern: str | None) -> list[str]:
        """The parameters one checkpoint tensor makes: `target` (as transformers renames it), and where its
        converter splits it (Param2MoE's query_key_value into q_proj, k_proj and v_proj), the others too:
        transformers' renaming names only the first."""
        converter = next((c for c in self._converters if source_pattern in c.source_patterns), None)
        if converter is None or len(converter.target_patterns) == 1:
            return [target]
        first = converter.target_patterns[0]
        head, found, tail = target.rpartition(first)
        return [head + other + tail for other in converter.target_patterns] if found else [target]

    def buffer_sources(self, present: list[str], where: str) -> dict[str, str]:
        """The model's persistent buffers a checkpoint holding `present` gives -> the tensor that is each (the
        checkpoint checked as `sources`)."""
        sources = self.sources(present, where, buffers=True)
        return {name: keys[0] for name, keys in sources.items() if name in self._buffer_names}

    def bind_buffers(self, tensors: dict[str, Tensor], where: str) -> None:
        """The model's persistent buffers (by its names) set to a checkpoint's values, each in its own dtype: the
        constants its layers compute with beside their parameters (Apertus' xIELU beta and eps), which megatrain
        holds in the skeleton rather than trains; a shape the model does not hold is refused."""
        for name, value in tensors.items():
            owner, _, attribute = name.rpartition(".")
            module = self.skeleton.model.get_submodule(owner)
            held = module._buffers[attribute]
            if tuple(held.shape) != tuple(value.shape):
                raise GenericError(
                    f"{where}: {name} is {tuple(value.shape)} in the checkpoint, the model needs "
                    f"{tuple(held.shape)}; the checkpoint is for a different configuration"
                )
            module._buffers[attribute] = value.to(self.skeleton.device, held.dtype)

    def bound_buffers(self) -> dict[str, Tensor]:
        """The model's persistent buffers as its layers compute with them (a checkpoint's where bound), by its
        names: what transformers saves beside the parameters; one left on the meta device (made empty, never
        bound) is left out."""
        state = self.skeleton.model.state_dict()
        return {name: state[name] for name in self.buffers if not state[name].is_meta}

    def renamed(self, tensors: dict[str, Tensor], where: str) -> dict[str, str]:
        """The parameters a checkpoint holding `tensors` gives by renaming alone (one tensor, no conversion, the
        same shape: the parameter may be that tensor itself) -> the tensor's name; persistent buffers likewise."""
        sources, converted = self._made(list(tensors), where, buffers=True)
        shapes = {name: t.shape for name, t in self.skeleton.model.state_dict(keep_vars=True).items()}
        return {
            name: keys[0]
            for name, keys in sources.items()
            if len(keys) == 1 and name not in converted and shapes[name] == tensors[keys[0]].shape
        }

    def load(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Checkpoint tensors (all those making some parameters) -> those parameters, by the model's names, in
        fp32, as transformers' loader converts them."""
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig
        from transformers.utils import logging

        model = self.skeleton.model
        held = [(module, name, p) for module in model.modules() for name, p in module._parameters.items()]
        bar = logging.is_progress_bar_enabled()
        logging.disable_progress_bar()
        try:
            config = LoadStateDictConfig(weight_mapping=self._mapping, dtype=torch.float32)
            convert_and_load_state_dict_in_model(model, dict(tensors), config)
            loaded = {name: p.detach() for name, p in model.named_parameters() if not p.is_meta}
        finally:
            for module, name, p in held:  # (back to the meta parameters: tied ones stay one object)
                module._parameters[name] = p
            if bar:
                logging.enable_progress_bar()
        return loaded

    def save(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """Parameters by the model's names -> the tensors a checkpoint of the family holds (meta tensors give
        their names and shapes alone)."""
        from transformers.core_model_loading import revert_weight_conversion

        return revert_weight_conversion(self.skeleton.model, dict(tensors))
