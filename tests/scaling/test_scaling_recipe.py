import dataclasses

import numpy as np
import pytest

from scaling.flops import TRAINING_TO_FORWARD
from scaling.recipe import Candidate, MicroRecipe, Recipe

SCALES = [
    (MicroRecipe(), np.geomspace(1e12, 1e16, 9)),
    (Recipe(), np.geomspace(3e18, 1e23, 9)),
]


@pytest.mark.parametrize("recipe,budgets", SCALES, ids=["micro", "delphi"])
def test_candidates_spend_the_budget_and_respect_caps(recipe, budgets):
    for budget in budgets:
        plan = recipe.plan(budget)
        # Enough model sizes per budget for a quadratic valley fit.
        assert len(plan.candidates) >= 3, (budget, plan.rejected)
        assert len(plan.candidates) + len(plan.rejected) == len(recipe.widths)
        for c in plan.candidates:
            assert c.tokens == c.steps * c.batch_size * c.seq_len
            assert c.flops == pytest.approx(TRAINING_TO_FORWARD * c.forward_flops_per_token * c.tokens)
            # Integer steps: realised compute is within half a step of the budget.
            assert abs(c.flops / budget - 1) <= 0.5 / c.steps + 1e-12
            assert recipe.min_tokens_per_param * 0.99 <= c.tokens_per_param <= recipe.max_tokens_per_param * 1.01
            assert c.steps >= recipe.min_steps
            assert recipe.min_batch_size <= c.batch_size <= recipe.max_batch_size
            assert c.batch_size & (c.batch_size - 1) == 0
            assert c.learning_rate <= recipe.max_learning_rate
            assert recipe.min_beta2 <= c.beta2 <= recipe.max_beta2
            assert c.hidden_dim == c.num_heads * recipe.head_dim
            assert c.params == c.dims.param_count()
            assert 0 < c.warmup < c.steps
        # Larger models, fewer tokens: the sweep straddles the optimum from both sides.
        ratios = [c.tokens_per_param for c in plan.candidates]
        assert ratios == sorted(ratios, reverse=True)


def test_transfer_rules_follow_batch_and_tokens():
    recipe = Recipe()
    tokens = 1e10
    # lr ~ sqrt(batch / tokens), epsilon ~ 1 / sqrt(batch / tokens), lr ~ 1 / width.
    assert recipe.learning_rate(64, tokens, 1024) / recipe.learning_rate(16, tokens, 1024) == pytest.approx(2.0)
    assert recipe.learning_rate(16, tokens / 4, 1024) / recipe.learning_rate(16, tokens, 1024) == pytest.approx(2.0)
    assert recipe.learning_rate(16, tokens, 2048) / recipe.learning_rate(16, tokens, 1024) == pytest.approx(0.5)
    assert recipe.epsilon(64, tokens) / recipe.epsilon(16, tokens) == pytest.approx(0.5)
    # beta2 keeps a constant averaging window in tokens: doubling the batch squares it.
    assert recipe.beta2(16) == pytest.approx(recipe.beta2(8) ** 2)
    reference = recipe.reference_batch_tokens / recipe.seq_len
    assert recipe.learning_rate(int(reference), recipe.reference_tokens, recipe.reference_width) == pytest.approx(
        recipe.learning_rate_at_reference
    )


def test_fork_with_replace():
    base = MicroRecipe()
    narrow = dataclasses.replace(base, max_tokens_per_param=50.0, vocab_size=512, seq_len=64)
    budget = 1e14
    forked = narrow.candidates(budget)
    assert all(c.tokens_per_param <= 50.0 * 1.01 for c in forked)
    assert all(c.vocab_size == 512 and c.seq_len == 64 for c in forked)
    assert any(c.tokens_per_param > 50.0 for c in base.candidates(budget))
    assert any("tokens/param > max 50" in r.reason for r in narrow.plan(budget).rejected)
    assert base.vocab_size == 4096  # forking leaves the original alone


def test_candidate_to_dict():
    candidate = MicroRecipe().candidates(1e14)[0]
    record = candidate.to_dict()
    for key in ("hidden_dim", "intermediate_dim", "num_layers", "num_heads", "num_kv_heads", "seq_len",
                "batch_size", "steps", "tokens", "params", "flops", "learning_rate", "beta2", "epsilon",
                "weight_decay", "warmup", "run_name", "tokens_per_param"):  # fmt: skip
        assert key in record
    assert record["run_name"] == candidate.run_name == \
        f"micro-1e+14-d{candidate.hidden_dim}-L{candidate.num_layers}-B{candidate.batch_size}"
    fields = {f.name for f in dataclasses.fields(Candidate)}
    assert Candidate(**{k: v for k, v in record.items() if k in fields}) == candidate


def test_invalid_recipes_and_budgets_are_rejected():
    with pytest.raises(ValueError, match="multiple of head_dim"):
        Recipe(widths=(500,))
    with pytest.raises(ValueError, match="query_heads_per_kv_head"):
        MicroRecipe(widths=(48,), query_heads_per_kv_head=2)
    with pytest.raises(ValueError, match="tokens_per_param"):
        MicroRecipe(min_tokens_per_param=10.0, max_tokens_per_param=5.0)
    with pytest.raises(ValueError, match="budget"):
        MicroRecipe().plan(-1.0)


def test_budget_far_below_the_grid_yields_only_rejections():
    plan = MicroRecipe().plan(1e8)
    assert plan.candidates == ()
    assert len(plan.rejected) == len(MicroRecipe().widths)
    assert all("tokens/param < min" in r.reason or "steps <" in r.reason for r in plan.rejected)
