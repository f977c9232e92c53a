"""The learning-rate schedules against transformers' schedulers, as docs/guide.md names them: after the warmup,
`cosine` is transformers' `cosine_with_min_lr`, `linear` with min_lr_ratio 0 its `linear`, and `wsd` its
`warmup_stable_decay` of each decay type. (The warmups differ by design: megatrain's first step trains at lr / W,
transformers' at 0.)"""

import pytest
import torch
import transformers

from megatrain_optim import Schedule, lr_at

TOTAL, WARMUP, DECAY, FLOOR = 40, 6, 13, 0.1


def transformers_rates(name: str, **kwargs) -> list[float]:
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([parameter], lr=1.0)
    scheduler = transformers.get_scheduler(
        name, optimizer, num_warmup_steps=WARMUP, num_training_steps=TOTAL, scheduler_specific_kwargs=kwargs
    )
    rates = []
    for _ in range(TOTAL):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize(
    "settings, name, kwargs",
    [
        ({"kind": "cosine"}, "cosine_with_min_lr", {"min_lr_rate": FLOOR}),
        ({"kind": "linear", "min_lr_ratio": 0.0}, "linear", {}),
        *(
            ({"kind": "wsd", "decay_steps": DECAY, "decay_shape": shape}, "warmup_stable_decay",
             {"num_decay_steps": DECAY, "decay_type": shape, "min_lr_ratio": FLOOR})
            for shape in ("cosine", "linear", "1-sqrt")
        ),
    ],
)  # fmt: skip
def test_a_schedule_decays_as_transformers_scheduler(settings, name, kwargs):
    schedule = Schedule(**{"lr": 1.0, "total_steps": TOTAL, "warmup_steps": WARMUP, "min_lr_ratio": FLOOR, **settings})
    ours = [lr_at(step, schedule) for step in range(TOTAL)]
    theirs = transformers_rates(name, **kwargs)
    assert ours[WARMUP:] == pytest.approx(theirs[WARMUP:], rel=1e-12, abs=1e-15)
    assert ours[:WARMUP] == pytest.approx([(step + 1) / WARMUP for step in range(WARMUP)])
