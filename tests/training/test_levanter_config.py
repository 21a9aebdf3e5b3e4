import copy
import dataclasses

import pytest
from conftest import FAMILY_MODELS, MIXTURE, tiny_spec

from marin_assets.training.levanter_config import (
    WandbSettings,
    build_train_config,
    parse_train_config,
    run_id_for,
    write_train_config,
)


def test_config_parses_into_levanter_train_lm_config(tmp_path, tiny_artifact, tiny_mixture):
    from levanter.data.text import LMMixtureDatasetConfig
    from levanter.main.train_lm import TrainLmConfig
    from levanter.models.llama import LlamaConfig

    cache_root, tokenizer_dir = tiny_artifact
    spec = tiny_spec(checkpoint_every=7)
    cfg = build_train_config(spec, tiny_mixture, tokenizer_dir, str(tmp_path),
                             wandb=WandbSettings(project="p", tags=("a",)))
    parsed = parse_train_config(write_train_config(cfg, tmp_path / "train_config.yaml"))
    assert isinstance(parsed, TrainLmConfig)
    assert isinstance(parsed.data, LMMixtureDatasetConfig) and isinstance(parsed.model, LlamaConfig)
    assert parsed.data.configs[MIXTURE].cache_dir == cache_root
    assert parsed.data.tokenizer == tokenizer_dir == parsed.model.tokenizer
    assert (parsed.model.hidden_dim, parsed.model.num_layers, parsed.model.seq_len) == (32, 2, 64)
    assert parsed.trainer.require_accelerator is False
    assert parsed.trainer.ray.auto_start_cluster is False
    assert parsed.trainer.id == run_id_for(spec)
    assert parsed.trainer.checkpointer.base_path == str(tmp_path / "checkpoints")
    assert parsed.trainer.checkpointer.append_run_id_to_base_path is False
    assert parsed.trainer.checkpointer.keep == [{"every": 7}]
    assert parsed.trainer.tracker.mode == "offline" and parsed.trainer.tracker.project == "p"
    assert parsed.optimizer.learning_rate == spec.optimizer.learning_rate
    assert parsed.trainer.num_train_steps == 30 and parsed.trainer.train_batch_size == 8
    assert parsed.trainer.watch.interval == spec.watch_every == 10
    unwatched = build_train_config(dataclasses.replace(spec, watch_every=0), tiny_mixture, tokenizer_dir, str(tmp_path))
    assert not parse_train_config(write_train_config(unwatched, tmp_path / "unwatched.yaml")).trainer.watch.is_enabled
    # the caller's mixture dict is not mutated
    assert "shuffle" not in tiny_mixture


def test_config_rejects_mixtures_that_would_tokenize_or_mismatch(tmp_path, tiny_artifact, tiny_mixture):
    _, tokenizer_dir = tiny_artifact
    raw = copy.deepcopy(tiny_mixture)
    raw["configs"][MIXTURE]["train_urls"] = ["gs://bucket/raw/*.jsonl.gz"]
    with pytest.raises(ValueError, match="pre-built caches only"):
        build_train_config(tiny_spec(), raw, tokenizer_dir, str(tmp_path))
    with pytest.raises(ValueError, match="differs from tokenizer_dir"):
        build_train_config(tiny_spec(), tiny_mixture, str(tmp_path / "other-tok"), str(tmp_path))
    with pytest.raises(ValueError, match="eval_sets"):
        build_train_config(tiny_spec(eval_sets=("nope",)), tiny_mixture, tokenizer_dir, str(tmp_path))
    with pytest.raises(ValueError, match="configs"):
        build_train_config(tiny_spec(), {"train_weights": {}}, tokenizer_dir, str(tmp_path))


def test_preflight_rejects_tokenizer_with_fields_missing_from_cache(tmp_path, tiny_artifact, tiny_mixture):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from marin_assets.training.train_main import check_caches_readable

    _, tokenizer_dir = tiny_artifact
    good = parse_train_config(write_train_config(
        build_train_config(tiny_spec(), tiny_mixture, tokenizer_dir, str(tmp_path)), tmp_path / "a.yaml"))
    check_caches_readable(good.data)

    # The same vocabulary saved with HF defaults returns token_type_ids, which the cache lacks.
    loaded = AutoTokenizer.from_pretrained(tokenizer_dir)
    PreTrainedTokenizerFast(tokenizer_object=loaded.backend_tokenizer, bos_token=loaded.bos_token,
                            eos_token=loaded.eos_token).save_pretrained(tmp_path / "tok")
    mixture = dict(tiny_mixture, tokenizer=str(tmp_path / "tok"))
    bad = parse_train_config(write_train_config(
        build_train_config(tiny_spec(), mixture, str(tmp_path / "tok"), str(tmp_path)), tmp_path / "b.yaml"))
    with pytest.raises(ValueError, match="token_type_ids"):
        check_caches_readable(bad.data)


def test_parallelism_renders_levanters_mesh_axes(tmp_path, tiny_artifact, tiny_mixture):
    from marin_assets.training.spec import ParallelismSpec, ResourceSpec

    _, tokenizer_dir = tiny_artifact
    fsdp = tiny_spec(resources=ResourceSpec(device_count=8), parallelism=ParallelismSpec(data=2, fsdp=4))
    trainer = parse_train_config(write_train_config(
        build_train_config(fsdp, tiny_mixture, tokenizer_dir, str(tmp_path)), tmp_path / "fsdp.yaml")).trainer
    # Levanter's replica axis is our data axis; it sizes its data (FSDP) axis as the devices left over.
    assert (trainer.replica_ici_axis_size, trainer.model_axis_size, trainer.tensor_parallel_axes) == (2, 1, None)
    assert trainer.compute_axis_mapping["batch"] == ("replica", "data")
    assert trainer.parameter_axis_mapping["embed"] == "data"

    tensor = tiny_spec(resources=ResourceSpec(accelerator="gpu", device_count=8), parallelism=ParallelismSpec(tensor=2))
    trainer = parse_train_config(write_train_config(
        build_train_config(tensor, tiny_mixture, tokenizer_dir, str(tmp_path)), tmp_path / "tensor.yaml")).trainer
    assert (trainer.replica_ici_axis_size, trainer.model_axis_size) == (4, 2)
    assert trainer.compute_axis_mapping["mlp"] == trainer.compute_axis_mapping["kv_head"] == "model"


@pytest.mark.parametrize("family", sorted(FAMILY_MODELS))
def test_each_family_renders_its_levanter_config_class(tmp_path, tiny_artifact, tiny_mixture, family):
    from levanter.models.lm_model import LmConfig
    from levanter.optim import LionConfig

    from marin_assets.training.train_main import model_spec_from_levanter

    _, tokenizer_dir = tiny_artifact
    base = tiny_spec()
    spec = dataclasses.replace(base, model=dataclasses.replace(base.model, family=family, **FAMILY_MODELS[family]),
                               optimizer=dataclasses.replace(base.optimizer, type="lion"))
    cfg = build_train_config(spec, tiny_mixture, tokenizer_dir, str(tmp_path))
    parsed = parse_train_config(write_train_config(cfg, tmp_path / "train_config.yaml"))
    assert type(parsed.model) is LmConfig.get_choice_class(family)
    assert isinstance(parsed.optimizer, LionConfig) and parsed.optimizer.learning_rate == spec.optimizer.learning_rate
    if family == "mixtral":
        assert (parsed.model.n_routed_experts, parsed.model.num_experts_per_tok) == (4, 2)
    # What the training process reads back (for its FLOPs) is the spec's model.
    assert model_spec_from_levanter(parsed.model).dims(512) == spec.model.dims(512)
