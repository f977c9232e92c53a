"""The custom trainer of custom_trainer.py against plain PyTorch: the same model as an nn.Module, autograd and
torch.optim.AdamW, from the same weights on the same fresh random batches (run by `nox -s examples`, with the
six packages installed and not `megatrain`)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from custom_trainer import CustomTrainer, SmoothedHead  # noqa: E402
from reference_model import ReferenceLM  # noqa: E402

from megatrain_data import TokenWindows  # noqa: E402
from megatrain_optim import AdamWConfig  # noqa: E402


def smoothed_loss(reference, ids, labels, smoothing=0.1, z_weight=1e-4):
    """SmoothedHead's loss in plain PyTorch: the mean over trained tokens of label-smoothed cross-entropy plus the
    z-loss."""
    trained = labels != -100
    logits = reference.logits(ids)[trained]
    total = F.cross_entropy(logits, labels[trained], reduction="sum", label_smoothing=smoothing)
    return (total + z_weight * (logits.logsumexp(-1) ** 2).sum()) / trained.sum()


@pytest.mark.parametrize(
    "preset_name, head",
    [("tiny-llama", None), ("tiny-qwen2", None), ("tiny-qwen2", SmoothedHead)],  # (untied, tied; a loss of your own)
)
def test_custom_trainer_steps_equal_plain_pytorch(preset_name, head, tmp_path):
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    seed = int(torch.randint(0, 2**31, ()))
    trainer = CustomTrainer(preset_name, adamw, dtype=torch.float64, seed=seed, head=head)
    reference = ReferenceLM(trainer.model).double()
    reference.load_named({name: weight.clone() for name, weight in trainer.weights().items()})
    no_decay = [p for n, p in reference.named_parameters() if n.endswith("norm.weight") or n.endswith(".bias")]
    decay = [p for p in reference.parameters() if all(p is not q for q in no_decay)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": adamw.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=adamw.lr,
        betas=adamw.betas,
        eps=adamw.eps,
    )
    tokens = np.random.default_rng(int(torch.randint(0, 2**31, ()))).integers(0, trainer.model.vocab_size, 6 * 13 * 3)
    windows = TokenWindows(tokens, seq_len=13, batch_size=6, shuffle=True, seed=0)
    for step in range(3):
        batch = windows.batch(step)  # (the last position of each window has no label: -100)
        ids, labels = batch.input_ids, batch.labels
        loss = trainer.train_step(ids, labels, lr=1e-2)
        optimizer.zero_grad()
        expected = reference.loss(ids, labels) if head is None else smoothed_loss(reference, ids, labels)
        expected.backward()
        optimizer.step()
        assert loss == pytest.approx(expected.item(), rel=1e-10)
    ours = trainer.weights()
    # AdamW's g / (|g| + eps) scales a gradient entry's last-bit difference near eps by up to lr / eps = 1e4 (one
    # seed in ~400: an entry of 9.3e-7, summed in another order, moved its weight 1.2e-12); a wrong gradient would
    # move weights by ~lr
    for name, param in reference.named_parameters():
        assert torch.allclose(ours[name], param.detach(), rtol=1e-9, atol=1e-10), name
    trainer.save_pretrained(tmp_path)  # (its weights as written, by the names transformers loads)
    assert load_file(tmp_path / "model.safetensors").keys() == ours.keys()
    assert all(torch.equal(t, ours[name]) for name, t in load_file(tmp_path / "model.safetensors").items())
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == trainer.model.arch
    trainer.close()
