"""A custom trainer composed from megatrain's pieces, without the `megatrain` package: a model from the zoo, its
state in a host store, AdamW applied as gradients land, and the layer-streaming pipeline running a placement you
write yourself (here the last block keeps its matmul products, the first holds its weights from forward to
backward); its batches are token windows of the data package. `examples/test_custom_trainer.py` checks its steps
against plain PyTorch and torch.optim.AdamW. Rows of packed documents or padding (a data `Batch` with position_ids or
valid) go in as `MicroBatch(ids, labels, documents=megatrain_templates.Documents(position_ids, valid))`, a micro-batch's
rows of each; `save_pretrained` writes a directory transformers loads. A loss on the logits of your own (label
smoothing and PaLM's z-loss here) is a head template whose `loss` computes it: `SmoothedHead`.

    pip install torch==2.13.0 ./packages/store ./packages/optim ./packages/sched ./packages/templates ./packages/zoo \
        ./packages/data
    python examples/custom_trainer.py
"""

import getpass
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from megatrain_data import DataSection, TokenWindows, load_token_data
from megatrain_optim import STATE_NAMES, AdamWConfig, HostAdamW, HostUpdates, UpdatesAsGradientsLand
from megatrain_sched import Hooks, LayerPipeline, MicroBatch, Placement, Stage
from megatrain_store import GroupLayout, HostStore, write_safetensors
from megatrain_templates import Head
from megatrain_zoo import build_model, config_to_hf, init_param_, preset


class SmoothedHead(Head):
    """The zoo's head of a model with a loss of your own on its logits: cross-entropy with label smoothing plus PaLM's
    z-loss (z_weight * logsumexp(logits)^2 a token). A head's `loss` returns its micro-batch's summed loss and the
    gradient of loss_scale x that loss with respect to `hidden`, adding its weights' gradients into `grads` (a frozen
    group's: None): here by autograd over `Head.logits`, all [rows, seq, vocab] at once where the zoo's head goes a
    chunk of rows at a time. Evaluation (`loss_sum`) stays plain cross-entropy."""

    def __init__(self, head: Head, smoothing: float = 0.1, z_weight: float = 1e-4):
        self.__dict__.update(vars(head))  # (the head as the zoo built it for this model: its norm, tying, spans)
        self.smoothing, self.z_weight = smoothing, z_weight

    def loss(self, weights, hidden, labels, loss_scale, grads):
        with torch.enable_grad():
            leaves = [w.detach().requires_grad_(True) for w in weights]
            x = hidden.detach().requires_grad_(True)
            trained = labels != -100
            logits = self.logits(leaves, x)[trained]
            loss = F.cross_entropy(logits, labels[trained], reduction="sum", label_smoothing=self.smoothing)
            loss = loss + self.z_weight * (logits.logsumexp(-1) ** 2).sum()
            grad_hidden, *grad_weights = torch.autograd.grad(loss * loss_scale, [x, *leaves])
        for into, grad in zip(grads, grad_weights):
            if into is not None:
                into += grad
        return loss.detach(), grad_hidden


class CustomTrainer:
    """Trains a zoo preset on `device`, every parameter and AdamW moment in host memory; `head`, given the zoo's head
    template, returns the one to train with (e.g. `SmoothedHead`)."""

    def __init__(self, preset_name: str, adamw: AdamWConfig, dtype=torch.float32, device="cpu", seed=0, head=None):
        self.model = preset(preset_name)
        spec = build_model(self.model)
        templates = [stage.template for stage in spec.stages]
        if head is not None:
            templates[-1] = head(templates[-1])
        layouts = [
            GroupLayout.from_specs((p.name, p.shape, p.weight_decay, p.update) for p in g.params) for g in spec.groups
        ]
        # fp32 masters and moments; gradients land in a pool of three groups' room and are updated as they land
        self.store = HostStore(layouts, dtype, STATE_NAMES, grad_pool=3)
        for group in range(self.store.n_groups):
            with self.store.writing(group) as views:
                for name, view in views.items():
                    init_param_(name, view, self.model, seed)
        first_use = {}  # the worker updates first what the next forward needs first
        for index, stage in enumerate(spec.stages):
            for group in stage.groups:
                first_use.setdefault(group, index)
        self.updates = HostUpdates(HostAdamW(self.store, adamw), first_use, [g.name for g in spec.groups])
        self.policy = UpdatesAsGradientsLand(self.updates)
        n_stages = len(spec.stages)  # the embedding, the blocks, the head
        placement = Placement.build(n_stages, held=(1,), kept=(n_stages - 2,))
        self.pipeline = LayerPipeline(
            [Stage(template, s.groups, s.name) for template, s in zip(templates, spec.stages)],
            self.store,
            torch.device(device),
            placement=placement,
            hooks=Hooks(
                before_fetch=self.updates.wait, updates_done=self.updates.done, on_grads_landed=self.policy.grads_landed
            ),
        )
        self.step_index = 0

    def train_step(self, input_ids: torch.Tensor, labels: torch.Tensor, lr: float, micro_batch: int = 2) -> float:
        """One AdamW step on [batch, seq] tokens (labels -100: no loss), in micro-batches; the mean token loss."""
        n_targets = int((labels != -100).sum())
        micro = [MicroBatch(i, t) for i, t in zip(input_ids.split(micro_batch), labels.split(micro_batch))]
        self.policy.begin_step(self.step_index, lr)
        result = self.pipeline.run(micro, loss_scale=1.0 / n_targets)
        sq_norm_sum = result.group_sq_norms.sum()
        self.policy.gradients_complete(result.loss_sum, sq_norm_sum)  # (a policy's GPU updates start here)
        self.policy.end_step(skipped=False)
        self.step_index += 1
        return result.loss_sum.item() / n_targets

    def weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by Hugging Face name, up to date."""
        self.updates.wait_all()
        return {name: view for g in range(self.store.n_groups) for name, view in self.store.master_views(g).items()}

    def save_pretrained(self, out_dir: Path) -> None:
        """A Hugging Face model directory of the weights now (config.json, fp32 model.safetensors), which
        transformers' AutoModelForCausalLM loads; the tokenizer's files are the data's to copy beside it."""
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(config_to_hf(self.model), indent=2))
        write_safetensors(out_dir / "model.safetensors", self.weights(), metadata={"format": "pt"})

    def close(self) -> None:
        self.updates.close()


if __name__ == "__main__":
    trainer = CustomTrainer("tiny-llama", AdamWConfig(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1))
    # the built-in corpus, with a tokenizer trained on it to fit the tiny vocabulary (cached in the temporary folder)
    cache = Path(tempfile.gettempdir()) / f"megatrain-custom-trainer-{getpass.getuser()}"
    data = load_token_data(DataSection(seq_len=32), trainer.model.vocab_size, cache, model_dir=None)
    windows = TokenWindows(data.train, seq_len=32, batch_size=4, shuffle=True, seed=0)
    for step in range(5):
        batch = windows.batch(step)
        print(f"step {step}: loss {trainer.train_step(batch.input_ids, batch.labels, lr=1e-3):.4f}")
    trainer.save_pretrained(cache / "model")
    print(f"saved {cache / 'model'}")
    trainer.close()
