"""Group advantages against formulas written out here."""

import math

import pytest
import torch

from grpo_dist.advantages import ADV_EPS, group_advantages, zero_advantage_groups

pytestmark = pytest.mark.fast  # the `make fast` tier


def test_worked_example():
    adv = group_advantages(torch.tensor([1.0, 1.0, 0.0, 0.0]), 4)
    assert torch.allclose(adv, torch.tensor([0.8659, 0.8659, -0.8659, -0.8659]), atol=1e-4)


def test_group_scaling_matches_formula():
    g = torch.Generator().manual_seed(0)
    r = torch.rand(5 * 6, generator=g)
    adv = group_advantages(r, 6, "group")
    for k in range(5):
        grp = r[k * 6:(k + 1) * 6].tolist()
        mean = sum(grp) / 6
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / 5)  # unbiased
        for j in range(6):
            assert abs(adv[k * 6 + j].item() - (grp[j] - mean) / (std + ADV_EPS)) < 1e-5


def test_batch_and_none_scaling():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    none = group_advantages(r, 4, "none")
    assert torch.allclose(none, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.25, 0.25, 0.25, -0.75]))
    batch = group_advantages(r, 4, "batch")
    std = math.sqrt(sum((x - 0.5) ** 2 for x in r.tolist()) / 7)
    assert torch.allclose(batch, none / (std + ADV_EPS), atol=1e-6)
    # an explicit global std (from all ranks) is used as given
    assert torch.allclose(group_advantages(r, 4, "batch", batch_std=2.0), none / (2.0 + ADV_EPS))


def test_identical_rewards_give_zero_advantage():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.0, 0.5])
    adv = group_advantages(r, 3)
    assert torch.all(adv[:6] == 0)
    assert zero_advantage_groups(r, 3).tolist() == [True, True, False]
