import pytest

from scaling.flops import (
    ModelDims,
    forward_flops_per_token,
    param_count,
    training_flops_per_token,
)
from scaling.recipe import MicroRecipe, Recipe

CONFIGS = [
    # hidden, intermediate, layers, heads, kv heads, vocab, seq_len, tied
    (64, 256, 2, 4, 4, 4096, 128, True),
    (256, 688, 4, 8, 2, 32000, 256, False),
    (768, 3072, 12, 12, 12, 50257, 1024, False),
    (4096, 14336, 32, 32, 8, 128256, 4096, False),
]


@pytest.mark.slow  # imports Levanter and jax (about 15 s on 2 loaded cores)
@pytest.mark.parametrize("hidden,intermediate,layers,heads,kv_heads,vocab,seq_len,tied", CONFIGS)
def test_matches_levanter_llama(hidden, intermediate, layers, heads, kv_heads, vocab, seq_len, tied):
    from levanter.models.llama import LlamaConfig

    config = LlamaConfig(
        seq_len=seq_len,
        hidden_dim=hidden,
        intermediate_dim=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        tie_word_embeddings=tied,
    )
    dims = ModelDims(hidden, intermediate, layers, heads, kv_heads, vocab, tie_word_embeddings=tied)
    assert dims.forward_flops_per_token(seq_len) == pytest.approx(config.flops_per_token(vocab), rel=1e-12)
    assert dims.param_count() == config.total_trainable_params(vocab)
    assert dims.training_flops_per_token(seq_len) == pytest.approx(3 * config.flops_per_token(vocab), rel=1e-12)


# family, Levanter config fields beyond the shape, ModelDims fields beyond the shape
FAMILY_SHAPES = [
    ("llama", {}, {}),
    ("llama", {"head_dim": 24}, {"head_size": 24}),  # a head size other than hidden / heads
    ("qwen", {}, {}),
    ("qwen", {"tie_word_embeddings": True}, {"tie_word_embeddings": True}),
    ("qwen3", {}, {}),
    ("olmo2", {}, {}),
    ("mixtral", {"n_routed_experts": 4, "num_experts_per_tok": 2}, {"num_experts": 4, "experts_per_token": 2}),
    ("mixtral", {"n_routed_experts": 3, "num_experts_per_tok": 1, "tie_word_embeddings": True},
     {"num_experts": 3, "experts_per_token": 1, "tie_word_embeddings": True}),
]


@pytest.mark.slow  # imports Levanter and jax
@pytest.mark.parametrize("family,levanter_fields,dims_fields", FAMILY_SHAPES)
def test_each_family_matches_the_model_levanter_builds(family, levanter_fields, dims_fields):
    """Parameters: Levanter's count of the model it initializes (shapes only, nothing computed), what
    training reports as ``parameter_count``; the configs' own ``total_trainable_params`` miss Qwen 2's
    biases and Qwen 3's norms. FLOPs: the config's ``flops_per_token``, what Levanter's throughput logs use."""
    import equinox as eqx
    import haliax as hax
    import jax
    import levanter.models.mixtral  # noqa: F401 - registers the family
    import levanter.models.olmo  # noqa: F401 - registers the family
    import levanter.models.qwen  # noqa: F401 - registers the family
    from levanter.models.lm_model import LmConfig
    from levanter.utils.jax_utils import parameter_count

    shape = {"hidden_dim": 64, "intermediate_dim": 96, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2}
    vocab, seq_len = 300, 128
    config = LmConfig.get_choice_class(family)(seq_len=seq_len, **shape, **levanter_fields)
    model = eqx.filter_eval_shape(config.build, hax.Axis("vocab", vocab), key=jax.random.PRNGKey(0))
    dims = ModelDims(**shape, vocab_size=vocab, family=family, **dims_fields)
    assert dims.param_count() == parameter_count(model)
    assert dims.forward_flops_per_token(seq_len) == pytest.approx(config.flops_per_token(vocab), rel=1e-12)
    assert dims.training_flops_per_token(seq_len) == 3 * dims.forward_flops_per_token(seq_len)


@pytest.mark.slow  # imports Levanter and jax
def test_recipe_models_match_levanter_flop_utils():
    from levanter.utils.flop_utils import lm_flops_per_token

    for recipe, budget in ((MicroRecipe(), 1e14), (Recipe(), 1e21)):
        for c in recipe.candidates(budget):
            expected = lm_flops_per_token(
                hidden_dim=c.hidden_dim,
                intermediate_dim=c.intermediate_dim,
                num_layers=c.num_layers,
                num_kv_heads=c.num_kv_heads,
                num_heads=c.num_heads,
                seq_len=c.seq_len,
                vocab_size=c.vocab_size,
                glu=True,
            )
            assert c.forward_flops_per_token == pytest.approx(expected, rel=1e-12)


def test_functional_forms_agree_and_dominant_term_is_2n():
    dims = {
        "hidden_dim": 2048,
        "intermediate_dim": 8192,
        "num_layers": 24,
        "num_heads": 16,
        "num_kv_heads": 16,
        "vocab_size": 50000,
    }
    forward = forward_flops_per_token(**dims, seq_len=2048)
    assert training_flops_per_token(**dims, seq_len=2048) == 3 * forward
    # Without attention scores the forward pass is 2 FLOPs per non-input-embedding parameter.
    non_embedding = param_count(**dims) - dims["vocab_size"] * dims["hidden_dim"]
    assert forward > 2 * non_embedding * 0.99
    assert forward < 2 * non_embedding * 1.2


def test_dims_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelDims(64, 256, 2, 4, 3, 100)
    with pytest.raises(ValueError, match="hidden_dim"):
        ModelDims(0, 256, 2, 4, 4, 100)
    with pytest.raises(ValueError, match="not one of"):
        ModelDims(64, 256, 2, 4, 4, 100, family="gpt2")
    with pytest.raises(ValueError, match="dense MLP"):
        ModelDims(64, 256, 2, 4, 4, 100, family="qwen", num_experts=4)
    with pytest.raises(ValueError, match="2 or more experts"):
        ModelDims(64, 256, 2, 4, 4, 100, family="mixtral", num_experts=4, experts_per_token=5)
