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


@pytest.mark.fast
@pytest.mark.parametrize("sizes, successes", [([2, 8], [1, 4]), ([4, 16], [1, 3]), ([3, 8, 12], [2, 1, 6])])
def test_sized_groups_weigh_a_prompt_by_its_group_size_minus_one(sizes, successes):
    """Group size by difficulty (docs/curriculum.md): with scale_rewards=group, a mixed group's z-scores have
    sum of squares (G - 1) * (std / (std + eps))^2 ~= G - 1, whatever its pass rate, so under one global normaliser
    a prompt given G_p completions counts (G_p - 1) / (G_q - 1) as much as one given G_q: a group of 2 counts 1/7 of a
    group of 8. For binary rewards with k of G correct, sum |A| = 2 sqrt(k (G - k) (G - 1) / G)."""
    rewards = torch.cat([torch.tensor([1.0] * k + [0.0] * (g - k)) for g, k in zip(sizes, successes)])
    adv = group_advantages(rewards, sizes).double()
    for grp, g, k in zip(torch.split(adv, sizes), sizes, successes):
        std = math.sqrt(k * (g - k) / (g * (g - 1)))
        assert float((grp ** 2).sum()) == pytest.approx((g - 1) * (std / (std + ADV_EPS)) ** 2, rel=1e-5)
        assert float(grp.abs().sum()) == pytest.approx(2 * math.sqrt(k * (g - k) * (g - 1) / g), rel=1e-3)
