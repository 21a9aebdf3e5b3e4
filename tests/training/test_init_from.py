"""Training from weights (`RunSpec.init_from`): the spec and its identity, resolving a source (a local
directory, the Hub through a local stand-in, another run's export through the checkpoint asset),
the training process's checks, and a run that starts from a random Llama written with transformers."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import dagster as dg
import data_fixtures
import numpy as np
import pytest
import yaml
from conftest import SUBPROCESS_ENV, tiny_spec

from marin_assets.curation.content_hashes import ContentHashCache
from marin_assets.training.init_weights import (
    InitWeightsError,
    check_weights,
    resolve_path,
    stage_weights,
    weights_digest,
)
from marin_assets.training.spec import InitFrom, RunSpecError, load_run_registry
from marin_assets.training.train_main import INPUT_ERROR_FILE, METRICS_FILE


def _hub_standin():
    path = Path(__file__).parents[1] / "curation" / "hub_standin.py"
    spec = importlib.util.spec_from_file_location("hub_standin", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hub_standin"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.HubStandIn


HubStandIn = _hub_standin()
TINY = tiny_spec().model


def write_hf_llama(out: Path, *, vocab_size: int, seed: int = 0, **overrides):
    """A random Llama of the tiny spec's shape made by transformers (Flax), saved as a Hugging Face
    checkpoint is: PyTorch key names and layouts in model.safetensors, and config.json."""
    import jax.numpy as jnp
    from flax.traverse_util import flatten_dict
    from safetensors.numpy import save_file
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=TINY.hidden_dim, intermediate_size=TINY.intermediate_dim,
                         num_hidden_layers=TINY.num_layers, num_attention_heads=TINY.num_heads,
                         num_key_value_heads=TINY.num_kv_heads, max_position_embeddings=TINY.seq_len,
                         rms_norm_eps=TINY.layer_norm_epsilon, rope_theta=TINY.rope_theta, tie_word_embeddings=False,
                         **overrides)
    model = FlaxLlamaForCausalLM(config, seed=seed, dtype=jnp.float32)
    state = {}
    for path, value in flatten_dict(model.params).items():
        *prefix, leaf = path
        array = np.asarray(value, dtype=np.float32)
        # Flax keeps Dense kernels as (in, out); PyTorch's Linear weight is (out, in).
        state[".".join([*prefix, "weight" if leaf in ("kernel", "embedding") else leaf])] = \
            np.ascontiguousarray(array.T if leaf == "kernel" else array)
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    return model


def train_from(weights_dir: Path, out: Path, tiny_artifact,
               tiny_mixture) -> tuple[str, Path, subprocess.CompletedProcess]:
    """A 2-step tiny run from ``weights_dir``, resolved as the checkpoint asset resolves it, through
    ``train_main``: (its config, its directory, the finished process)."""
    from marin_assets.training.levanter_config import build_train_config, write_train_config

    with ContentHashCache(out.parent / "hashes.sqlite") as hashes:
        weights = resolve_path(str(weights_dir), hashes)
    spec = tiny_spec(steps=2, watch_every=0, init_from=InitFrom(path=str(weights_dir)))
    config = write_train_config(build_train_config(spec, tiny_mixture, tiny_artifact[1], str(out),
                                                   init_weights=weights),
                                out / "train_config.yaml")
    proc = subprocess.run([sys.executable, "-m", "marin_assets.training.train_main", "--config", config,
                           "--output-dir", str(out), "--init-sha256", weights.sha256],
                          env={**os.environ, **SUBPROCESS_ENV}, capture_output=True, text=True, timeout=900, cwd=out)
    return config, out, proc


# ---- the spec --------------------------------------------------------------------------------------


def test_runs_from_scratch_keep_their_fingerprints():
    """The fingerprints these runs had before init_from existed: their artifacts stay theirs."""
    assert load_run_registry()["nano-shakespeare"].fingerprint() == \
        "cf19bfbff4fcdf3b6600a50a2a6298bfc784d9f00481744c62c632bea1a1f04e"
    assert tiny_spec().fingerprint() == "f91845d3f4b28f4f402adc8b5824c2f292993fa5c1c5f79db9dbc2b74f976fbe"
    assert "init_from" not in tiny_spec().identity()


def test_the_weights_content_hash_is_part_of_the_identity():
    spec = tiny_spec(init_from=InitFrom(path="/weights/llama"))
    assert spec.identity("a" * 64)["init_from"] == {"path": "/weights/llama", "sha256": "a" * 64}
    assert spec.fingerprint("a" * 64) != spec.fingerprint("b" * 64) != tiny_spec().fingerprint()
    assert spec.fingerprint("a" * 64) == tiny_spec(init_from=InitFrom(path="/weights/llama")).fingerprint("a" * 64)


def _registry(tmp_path, **runs) -> Path:
    base = {"mixture": "m", "tokenizer": "t", "optimizer": {"learning_rate": 0.001}, "train_batch_size": 8,
            "num_train_steps": 10, "model": {"hidden_dim": 32, "intermediate_dim": 64, "num_layers": 2,
                                             "num_heads": 2, "num_kv_heads": 2, "seq_len": 64}}
    path = tmp_path / "runs.yaml"
    path.write_text(yaml.safe_dump({"runs": {name: {**base, **fields} for name, fields in runs.items()}}))
    return path


@pytest.mark.parametrize(("runs", "message"), [
    ({"a": {"init_from": {"run": "b"}}}, "run 'a': field 'init_from.run': no run named 'b' in this file"),
    ({"a": {"init_from": {"run": "a"}}}, "run 'a': field 'init_from.run': a run cannot start from its own export"),
    ({"a": {"init_from": {"run": "b", "path": "/w"}}, "b": {}}, "run 'a': field 'init_from': give exactly one"),
    ({"a": {"init_from": {"path": "weights/llama"}}}, "a local directory must be an absolute path"),
    ({"a": {"init_from": {"path": "hf://datasets/org/name"}}}, "expected hf://ORG/NAME[@REVISION]"),
    ({"a": {"init_from": {"run": "b"}}, "b": {"tokenizer": "other"}}, "run 'a': field 'tokenizer': 't' differs"),
    ({"a": {"init_from": {"run": "b"}}, "b": {"init_from": {"run": "a"}}}, "in a loop: a -> b -> a"),
    ({"a": {"cooldown": {"run": "b", "step": 5}, "optimizer": {"learning_rate": 0.001, "warmup": 0}},
      "b": {"checkpoint_every": 4}}, "run 'a': field 'cooldown.step': run 'b' keeps checkpoints step-S every 4 "
                                      "steps and its last, step-9; not step-5"),
    ({"a": {"cooldown": {"run": "b", "step": 9}}, "b": {}},
     "run 'a': field 'optimizer.warmup': a cooldown continues at its base's step without warmup"),
    ({"a": {"cooldown": {"run": "b", "step": 9}, "optimizer": {"learning_rate": 0.001, "warmup": 0, "type": "lion"}},
      "b": {}}, "run 'a': field 'optimizer.type': 'lion' differs from 'adam' of run 'b'"),
    ({"a": {"cooldown": {"run": "b", "step": 9}, "optimizer": {"learning_rate": 0.001, "warmup": 0}},
      "b": {"model": {"hidden_dim": 64, "intermediate_dim": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
                      "seq_len": 64}}},
     "run 'a': field 'model.hidden_dim': 32 differs from 64 of run 'b', whose checkpoint it starts from"),
    ({"a": {"cooldown": {"run": "c", "step": 9}, "optimizer": {"learning_rate": 0.001, "warmup": 0}}},
     "run 'a': field 'cooldown.run': no run named 'c' in this file"),
])
def test_a_bad_init_from_is_refused_in_one_line_when_the_runs_file_is_read(tmp_path, runs, message):
    with pytest.raises(RunSpecError) as err:
        load_run_registry(_registry(tmp_path, **runs))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_run_starting_from_another_run_must_have_its_architecture(tmp_path):
    wider = {"hidden_dim": 64, "intermediate_dim": 64, "num_layers": 2, "num_heads": 2, "num_kv_heads": 2,
             "seq_len": 64}
    with pytest.raises(RunSpecError, match="field 'model.hidden_dim': 32 differs from 64 of run 'b'"):
        load_run_registry(_registry(tmp_path, a={"init_from": {"run": "b"}}, b={"model": wider}))
    longer = {**wider, "hidden_dim": 32, "seq_len": 128}  # continued pretraining at another length is allowed
    assert load_run_registry(_registry(tmp_path, a={"init_from": {"run": "b"}}, b={"model": longer}))["a"].init_from


# ---- resolving a directory -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    data_fixtures.train_byte_bpe_tokenizer(data_fixtures.stdlib_docstrings()[:200], out, 300)
    return AutoTokenizer.from_pretrained(out)


@pytest.fixture
def llama_dir(tmp_path, tokenizer) -> Path:
    write_hf_llama(tmp_path / "llama", vocab_size=len(tokenizer))
    return tmp_path / "llama"


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_directory_resolves_to_the_hash_of_its_config_and_weights(llama_dir, tmp_path):
    with ContentHashCache(tmp_path / "hashes.sqlite") as hashes:
        weights = resolve_path(str(llama_dir), hashes)
        assert weights.uri == str(llama_dir)
        assert dict(weights.files) == {n: _sha256(llama_dir / n) for n in ("config.json", "model.safetensors")}
        assert weights.sha256 == weights_digest(dict(weights.files))
        blob = bytearray((llama_dir / "model.safetensors").read_bytes())
        blob[-1] ^= 1  # one bit of one weight
        (llama_dir / "model.safetensors").write_bytes(bytes(blob))
        assert resolve_path(str(llama_dir), hashes).sha256 != weights.sha256


@pytest.mark.parametrize(("damage", "message"), [
    (lambda d: (d / "config.json").unlink(), "llama: no config.json"),
    (lambda d: (d / "model.safetensors").unlink(), "llama: no model.safetensors or model.safetensors.index.json"),
    (lambda d: (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model-2.safetensors"}})),
     "llama/model-2.safetensors: listed in model.safetensors.index.json but not there"),
])
def test_a_directory_that_is_no_model_is_one_line_naming_the_missing_piece(llama_dir, tmp_path, damage, message):
    damage(llama_dir)
    with ContentHashCache(tmp_path / "hashes.sqlite") as hashes, pytest.raises(InitWeightsError) as err:
        resolve_path(str(llama_dir), hashes)
    assert message in str(err.value) and "\n" not in str(err.value)


def _expected(tokenizer, **changes) -> dict:
    from transformers import LlamaConfig

    config = json.loads(LlamaConfig(vocab_size=len(tokenizer), hidden_size=TINY.hidden_dim,
                                    intermediate_size=TINY.intermediate_dim, num_hidden_layers=TINY.num_layers,
                                    num_attention_heads=TINY.num_heads, num_key_value_heads=TINY.num_kv_heads,
                                    rms_norm_eps=TINY.layer_norm_epsilon, rope_theta=TINY.rope_theta,
                                    tie_word_embeddings=False).to_json_string())
    return {**config, **changes}


def test_weights_that_fit_the_run_pass_its_checks(llama_dir, tokenizer):
    assert check_weights(str(llama_dir), _expected(tokenizer), tokenizer)["vocab_size"] == len(tokenizer)


def _truncate(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])


def _set_config(**fields):
    def change(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **fields}))
    return change


def _narrower_up_projection(d: Path) -> None:
    """config.json still says the run's shape; one layer's tensor does not (a hand-edited or mixed checkpoint)."""
    from safetensors.numpy import load_file, save_file

    state = load_file(d / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:-8]
    save_file(state, d / "model.safetensors", metadata={"format": "pt"})


def _other_tokenizer(d: Path) -> None:
    data_fixtures.train_byte_bpe_tokenizer(data_fixtures.stdlib_docstrings()[200:400], d, 300)


@pytest.mark.parametrize(("damage", "message"), [
    (_truncate, "model.safetensors: truncated: "),
    (_set_config(model_type="gpt2", architectures=["GPT2LMHeadModel"]),
     "config.json: architecture GPT2LMHeadModel (model_type 'gpt2') is not supported here: this run trains "
     "LlamaForCausalLM"),
    (_set_config(num_hidden_layers=3), "config.json: num_hidden_layers is 3, the run's model has 2"),
    (_set_config(vocab_size=299), "config.json: vocab_size 299 does not match the run's tokenizer (300 entries)"),
    (_narrower_up_projection, f"model.safetensors: model.layers.1.mlp.up_proj.weight has shape "
                              f"[{TINY.intermediate_dim - 8}, {TINY.hidden_dim}]; config.json and the run's model "
                              f"make it [{TINY.intermediate_dim}, {TINY.hidden_dim}]"),
    (_other_tokenizer, "tokenizer.json: its vocabulary differs from the run's tokenizer"),
])
def test_weights_that_do_not_fit_are_one_line_naming_the_piece(llama_dir, tokenizer, damage, message):
    damage(llama_dir)
    with pytest.raises(InitWeightsError) as err:
        check_weights(str(llama_dir), _expected(tokenizer), tokenizer)
    assert message in str(err.value) and str(llama_dir) in str(err.value) and "\n" not in str(err.value)


def test_staging_refuses_bytes_other_than_the_resolved_ones(llama_dir, tmp_path):
    with ContentHashCache(tmp_path / "hashes.sqlite") as hashes:
        weights = resolve_path(str(llama_dir), hashes)
    assert stage_weights(weights.uri, weights.sha256, tmp_path / "scratch") == str(llama_dir)  # local: read in place
    _set_config(rope_theta=500000.0)(llama_dir)
    with pytest.raises(InitWeightsError, match="the weights changed since the run was resolved"):
        stage_weights(weights.uri, weights.sha256, tmp_path / "scratch")


# ---- the Hub, through a local stand-in --------------------------------------------------------------


@pytest.fixture
def hub(monkeypatch, llama_dir):
    from huggingface_hub import constants
    from huggingface_hub.utils import reset_sessions

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    reset_sessions()
    with HubStandIn() as standin:
        repo = standin.repo("model", "marin-test/tiny-llama")
        repo.commit({name: (llama_dir / name).read_bytes() for name in ("config.json", "model.safetensors")}, "weights")
        repo.commit({"README.md": b"# tiny llama\n"}, "a readme")
        monkeypatch.setenv("HF_ENDPOINT", standin.endpoint)
        yield standin
    reset_sessions()


def test_a_hub_model_is_pinned_to_its_commit_hashed_and_fetched(hub, llama_dir, tmp_path):
    commit = hub.repo("model", "marin-test/tiny-llama").commits[-1].sha
    with ContentHashCache(tmp_path / "hashes.sqlite") as hashes:
        weights = resolve_path("hf://marin-test/tiny-llama@main", hashes)
        local = resolve_path(str(llama_dir), hashes)
    assert weights.uri == f"hf://marin-test/tiny-llama@{commit}"
    assert weights.sha256 == local.sha256  # the same bytes, wherever they are
    staged = Path(stage_weights(weights.uri, weights.sha256, tmp_path / "scratch"))
    assert staged == tmp_path / "scratch"
    assert (staged / "model.safetensors").read_bytes() == (llama_dir / "model.safetensors").read_bytes()


@pytest.mark.parametrize(("path", "message"), [
    ("hf://marin-test/nothing-here", "no model repository 'marin-test/nothing-here'"),
    ("hf://marin-test/tiny-llama@no-such-branch", "has no revision 'no-such-branch'"),
])
def test_a_missing_hub_repo_or_revision_is_one_line(hub, tmp_path, path, message):
    with ContentHashCache(tmp_path / "hashes.sqlite") as hashes, pytest.raises(InitWeightsError) as err:
        resolve_path(path, hashes)
    assert message in str(err.value) and path in str(err.value)


# ---- the checkpoint asset: lineage and identity -----------------------------------------------------


class RecordingLauncher:
    """Builds a `TrainingLauncher` that trains nothing: it keeps each command and the config it was
    given, and writes the summary the checkpoint asset reads."""

    @staticmethod
    def make(calls: list, checkpoint_steps: tuple[int, ...] = ()):
        """``checkpoint_steps``: the `checkpoints/step-S` directories each run leaves, as Levanter would."""
        from marin_assets.training.train_main import SUMMARY_FILE
        from marin_resources.launchers import TrainingLauncher

        class Recording(TrainingLauncher):
            def wandb_online(self) -> bool:
                return False

            def run_process(self, context, process, *, resources=None, extras=None):
                out = Path(process.output_dir)
                calls.append((process, yaml.safe_load((out / "train_config.yaml").read_text())))
                (out / SUMMARY_FILE).write_text(json.dumps({"final_step": 10, "train_loss_first": 6.0,
                                                            "train_loss_last": 3.5}))
                for step in checkpoint_steps:
                    (out / "checkpoints" / f"step-{step}").mkdir(parents=True)
                    (out / "checkpoints" / f"step-{step}" / "metadata.json").write_text("{}")

        return Recording()


def _commit(store, key: str, partition: str | None, files: dict[str, bytes], metrics=None, config=None,
            version: str = "v1"):
    from marin_resources.storage.identity import fingerprint
    from marin_resources.storage.store import producer_info, writing

    config = config or {"name": key}
    with writing(store, key, version, partition, fingerprint=fingerprint(config), run_id="test") as writer:
        for name, data in files.items():
            with writer.open(name) as fh:
                fh.write(data)
        return writer.commit(config=config, upstream=[], producer=producer_info("test"), metrics=metrics or {})


def recording_checkpoint_stage(tmp_path, runs_file, synthetic_deployment, checkpoint_steps: tuple[int, ...] = ()):
    """The training stage over ``runs_file``'s runs (mixture ``m``, tokenizer ``t``, both committed) with
    a `RecordingLauncher`: (the checkpoint asset, its catalog, resources, store, recorded calls)."""
    checkpoint, catalog, resources, store, calls, _ = recording_training_stage(tmp_path, runs_file,
                                                                               synthetic_deployment, checkpoint_steps)
    return checkpoint, catalog, resources, store, calls


def recording_training_stage(tmp_path, runs_file, synthetic_deployment, checkpoint_steps: tuple[int, ...] = ()):
    """`recording_checkpoint_stage`, and the stage's definitions with those resources last."""
    from marin_assets.stages import build_stage
    from marin_assets.training.assets import build_training_stage
    from marin_resources.environments import MarinSettings, build_resources

    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"), "MARIN_RUNS": str(runs_file)})
    resources = build_resources(settings)
    store = resources["store"].get()
    cache = _commit(store, "tokenized/m", None, {"train/input_ids": b"rows"})
    _commit(store, "mixture/m", None, {"data.json": json.dumps({
        "cache_dir": None, "train_weights": {"m": 1.0}, "configs": {"m": {"cache_dir": cache.uri}}}).encode()})
    _commit(store, "tokenizer/t", None, {"tokenizer.json": b"{}"})
    calls: list = []
    resources["launcher"] = RecordingLauncher.make(calls, checkpoint_steps)
    defs, catalog = build_stage(build_training_stage, settings, synthetic_deployment(runs=load_run_registry(runs_file)))
    [checkpoint] = [a for a in defs.assets if a.key == dg.AssetKey("checkpoint")]
    return checkpoint, catalog, resources, store, calls, dg.Definitions.merge(defs, dg.Definitions(resources=resources))


def test_a_run_from_another_runs_export_records_it_as_an_input(tmp_path, llama_dir, synthetic_deployment):
    from marin_assets.training.assets import CHECKPOINT_VERSION
    from marin_resources.storage.lineage import build_lineage

    runs_file = _registry(tmp_path, base={}, tuned={"init_from": {"run": "base"}, "mixture": "m"},
                          broken={"init_from": {"path": str(tmp_path / "empty")}})
    (tmp_path / "empty").mkdir()
    checkpoint, catalog, resources, store, calls = recording_checkpoint_stage(tmp_path, runs_file,
                                                                              synthetic_deployment)
    from marin_assets.training.export_main import HF_MODEL_VERSION

    export = _commit(store, "hf_model", "base", {n: (llama_dir / n).read_bytes()
                                                 for n in ("config.json", "model.safetensors")},
                     version=HF_MODEL_VERSION)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("runs", ["base", "broken", "tuned"])
        result = dg.materialize([checkpoint], partition_key="tuned", instance=instance, resources=resources)
        assert result.success

        manifest = store.find("checkpoint", CHECKPOINT_VERSION, "tuned")
        digest = weights_digest({f.path: f.sha256 for f in export.files})
        assert manifest.config["init_from"] == {"run": "base", "sha256": digest}
        assert ("hf_model", "base") in manifest.upstream_versions()
        assert any(node.manifest is not None and node.manifest.asset_key == "hf_model"
                   for node in build_lineage(store, manifest).walk())
        assert catalog.specs["checkpoint"].identity("tuned") == manifest.config  # what `marin status` looks for
        [(process, config)] = calls
        assert config["initialize_from_hf"] == export.uri
        assert process.args[process.args.index("--init-sha256") + 1] == digest

        failed = dg.materialize([checkpoint], partition_key="broken", instance=instance, resources=resources,
                                raise_on_error=False)
        assert not failed.success and len(calls) == 1  # refused before any process started
        [failure] = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"]
        assert f"checkpoint[broken]: {tmp_path / 'empty'}: no config.json" in \
            failure.event_specific_data.error.message
        assert store.find("checkpoint", CHECKPOINT_VERSION, "broken") is None


def test_a_cooldown_continues_its_base_checkpoint_as_an_input(tmp_path, synthetic_deployment):
    from marin_assets.training.assets import CHECKPOINT_VERSION
    from marin_resources.storage.identity import fingerprint

    runs_file = _registry(tmp_path, base={"checkpoint_every": 5}, cool={
        "cooldown": {"run": "base", "step": 5}, "num_train_steps": 4,
        "optimizer": {"learning_rate": 0.001, "warmup": 0, "schedule": "linear", "min_lr_ratio": 0}})
    checkpoint, catalog, resources, store, calls = recording_checkpoint_stage(tmp_path, runs_file,
                                                                              synthetic_deployment)
    identity = catalog.specs["checkpoint"].identity
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("runs", ["base", "cool"])

        def refusal() -> str:
            failed = dg.materialize([checkpoint], partition_key="cool", instance=instance, resources=resources,
                                    raise_on_error=False)
            [failure] = [e for e in failed.all_events if e.event_type_value == "STEP_FAILURE"]
            return failure.event_specific_data.error.message

        assert "checkpoint[cool]: run 'cool' cools down from run 'base', whose checkpoint is not built as " \
               "declared: marin materialize checkpoint --partition base" in refusal()
        base = _commit(store, "checkpoint", "base", {"checkpoints/step-9/metadata.json": b"{}"},
                       config=identity("base"))
        assert "kept no checkpoints/step-5" in refusal() and not calls

        base = _commit(store, "checkpoint", "base", {f"checkpoints/step-{s}/metadata.json": b"{}" for s in (5, 9)},
                       config=identity("base"))
        assert dg.materialize([checkpoint], partition_key="cool", instance=instance, resources=resources).success
        manifest = store.find("checkpoint", CHECKPOINT_VERSION, "cool")
        assert manifest.config["cooldown"] == {"run": "base", "step": 5, "checkpoint": base.fingerprint}
        assert base.fingerprint == fingerprint(identity("base")) and identity("cool") == manifest.config
        assert ("checkpoint", "base") in manifest.upstream_versions()
        [(_, config)] = calls
        assert config["initialize_from_checkpoint_path"] == f"{base.uri}/checkpoints/step-5"
        # Step-5 holds 6 updates; 4 more, the learning rate annealed over those 4.
        assert config["trainer"]["num_train_steps"] == 10 and config["optimizer"]["decay"] == 4
    # Another base (a longer run) is another cooldown: its identity follows the base checkpoint's.
    longer = _registry(tmp_path, base={"checkpoint_every": 5, "num_train_steps": 20}, cool={
        "cooldown": {"run": "base", "step": 5}, "num_train_steps": 4,
        "optimizer": {"learning_rate": 0.001, "warmup": 0, "schedule": "linear", "min_lr_ratio": 0}})
    _, other, *_ = recording_checkpoint_stage(tmp_path / "other", longer, synthetic_deployment)
    assert other.specs["checkpoint"].identity("cool")["cooldown"]["checkpoint"] != base.fingerprint


@pytest.mark.slow  # builds the training stage, then Dagster runs through the planner
def test_marin_materialize_builds_a_cooldowns_base_first_and_status_follows_it(tmp_path, synthetic_deployment):
    """Dagster cannot declare that checkpoint[cool] reads checkpoint[zbase] (a dynamic partition may
    not depend on another of its own asset), so the planner does: asked for the cooldown alone, it
    trains the base first (though 'cool' sorts before 'zbase'), in a step the cooldown's waits for;
    and a base rebuilt since makes the cooldown stale, naming it."""
    from marin_assets.planning import Planner
    from marin_assets.training.assets import CHECKPOINT_VERSION

    runs_file = _registry(tmp_path, zbase={"checkpoint_every": 5}, cool={
        "cooldown": {"run": "zbase", "step": 5}, "num_train_steps": 4,
        "optimizer": {"learning_rate": 0.001, "warmup": 0, "schedule": "linear", "min_lr_ratio": 0}})
    *_, catalog, _, store, calls, defs = recording_training_stage(tmp_path, runs_file, synthetic_deployment,
                                                                  checkpoint_steps=(5, 9))
    checkpoint = dg.AssetKey("checkpoint")
    with dg.instance_for_test() as instance:
        plan = Planner(defs, catalog, store, instance)
        plan.discover()
        steps = plan.steps_of([(checkpoint, "cool")])
        assert [(s.partition, sorted(s.after)) for s in steps] == [("zbase", []), ("cool", [0])]
        results = plan.materialize_all([(checkpoint, "cool")], log=lambda *_: None)
        assert [(r.partition, r.ran, r.success) for r in results] == [("zbase", True, True), ("cool", True, True)]
        base = store.find("checkpoint", CHECKPOINT_VERSION, "zbase")
        assert [c["initialize_from_checkpoint_path"] for _, c in calls if "initialize_from_checkpoint_path" in c] \
            == [f"{base.uri}/checkpoints/step-5"]
        assert plan.state(checkpoint, "cool").state == "fresh"
        # The base rebuilt (same identity, new data): the cooldown continued the old one.
        _commit(store, "checkpoint", "zbase", {f"checkpoints/step-{s}/metadata.json": b"{}" for s in (5, 9, 10)},
                config=base.config, version=CHECKPOINT_VERSION)
        state = plan.state(checkpoint, "cool")
        assert state.state == "stale" and "checkpoint[zbase]" in state.cause, state


@pytest.mark.slow  # builds the training stage, then six Dagster runs
def test_a_checkpoint_records_the_cache_it_read_and_is_stale_once_the_cache_grows(tmp_path, synthetic_deployment):
    """Issue 50: a checkpoint trained on token cache A; new shards grew the cache to B in place. The
    mixture's data.json names the cache by path, so its data version stayed: status called the
    checkpoint fresh, and its lineage listed cache B. The checkpoint records the cache it read, its
    lineage names it (and says the store now holds another), and status calls it stale."""
    from marin_assets.catalog import Catalog
    from marin_assets.planning import Planner
    from marin_assets.stages import build_stage
    from marin_assets.tokenization.assets import build_mixture_asset
    from marin_assets.tokenization.registry import MixtureEntry
    from marin_assets.training.assets import CHECKPOINT_VERSION, build_training_stage
    from marin_resources.artifacts import VERSION_METADATA_KEY
    from marin_resources.environments import MarinSettings, build_resources
    from marin_resources.keys import asset_key
    from marin_resources.storage.lineage import build_lineage, render_tree

    settings = MarinSettings.from_env({"MARIN_PREFIX": str(tmp_path / "store"),
                                       "MARIN_RUNS": str(_registry(tmp_path, base={}))})
    resources = build_resources(settings)
    store = resources["store"].get()
    calls: list = []
    resources["launcher"] = RecordingLauncher.make(calls)
    _commit(store, "tokenizer/t", None, {"tokenizer.json": b"{}"})
    cache_a = _commit(store, "tokenized/src", None, {"train/input_ids": b"shards 1-3"})
    mixture_catalog = Catalog()
    mixture = build_mixture_asset(MixtureEntry("m", "t", {"src": 1.0}), mixture_catalog)
    inputs = [dg.AssetSpec(key=asset_key(k), metadata={VERSION_METADATA_KEY: "v1"}).with_io_manager_key(
        "artifact_io_manager") for k in ("tokenized/src", "tokenizer/t")]
    defs, catalog = build_stage(build_training_stage, settings, synthetic_deployment(runs=load_run_registry(
        tmp_path / "runs.yaml")))
    [checkpoint] = [a for a in defs.assets if a.key == dg.AssetKey("checkpoint")]
    everything = dg.Definitions(assets=[*inputs, mixture, checkpoint], resources=resources)
    with dg.instance_for_test() as instance:
        instance.add_dynamic_partitions("runs", ["base"])

        def build(asset, partition=None):
            assert dg.materialize([*inputs, asset], selection=[asset.key], partition_key=partition, instance=instance,
                                  resources=resources).success

        def status() -> str:
            planner = Planner(everything, catalog.merge(mixture_catalog), store, instance)
            return planner.state(dg.AssetKey("checkpoint"), "base").state

        build(mixture)
        mixture_a = store.find("mixture/m", "v1", None)
        build(checkpoint, "base")
        trained = store.find("checkpoint", CHECKPOINT_VERSION, "base")
        assert trained.upstream_versions()[("tokenized/src", None)] == cache_a.data_version
        assert status() == "fresh"

        cache_b = _commit(store, "tokenized/src", None, {"train/input_ids": b"shards 1-4"})  # appended in place
        assert cache_b.uri == cache_a.uri and cache_b.data_version != cache_a.data_version
        build(mixture)  # as automation does after the cache
        assert store.find("mixture/m", "v1", None).data_version != mixture_a.data_version
        assert status() == "stale"
        tree = render_tree(build_lineage(store, trained))
        assert f"data version {cache_b.data_version[:12]} != {cache_a.data_version[:12]} recorded by checkpoint" \
            in tree, tree

        build(checkpoint, "base")  # trained again, on the cache as it is now
        assert len(calls) == 2
        assert store.find("checkpoint", CHECKPOINT_VERSION, "base").upstream_versions()[("tokenized/src", None)] \
            == cache_b.data_version
        assert status() == "fresh"


# ---- training from weights --------------------------------------------------------------------------


@pytest.mark.slow
def test_levanter_starts_from_a_transformers_llama_at_its_loss(tmp_path, tiny_artifact, tiny_mixture):
    """A random Llama written with transformers: Levanter's first-step loss is the loss transformers
    gives the same model on the same batch."""
    import jax.numpy as jnp
    import jax.random as jrandom
    from transformers import AutoTokenizer, FlaxLlamaForCausalLM

    from marin_assets.tokenization.cache_format import name_tokenizer_as_ledgers_do
    from marin_assets.training.levanter_config import parse_train_config

    _, tokenizer_dir = tiny_artifact
    write_hf_llama(tmp_path / "llama", vocab_size=len(AutoTokenizer.from_pretrained(tokenizer_dir)), seed=3)
    config_path, out, proc = train_from(tmp_path / "llama", tmp_path / "run", tiny_artifact, tiny_mixture)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((out / METRICS_FILE).read_text().splitlines()[0])
    assert first["step"] == 0

    # The first batch as train_lm draws it (the data key is the first of four split from the seed).
    config = parse_train_config(config_path)
    name_tokenizer_as_ledgers_do(config.data)
    data_key = jrandom.split(jrandom.PRNGKey(config.trainer.seed), 4)[0]
    dataset = config.data.train_set(config.model.Pos, config.trainer.batch_schedule, key=data_key,
                                    epochs=config.epoch).as_sync_dataset()
    batch = np.stack([np.asarray(e.tokens.array)
                      for e in dataset.get_batch(list(range(config.trainer.train_batch_size)))])
    eos = config.data.the_tokenizer.eos_token_id

    # transformers on the same rows; Levanter's attention does not cross a document's end (EOS), so each
    # document's tokens are run alone, at the positions they hold in the row.
    model = FlaxLlamaForCausalLM.from_pretrained(tmp_path / "llama", dtype=jnp.float32)
    losses = []
    for row in batch:
        starts = [0] + [i + 1 for i in range(len(row) - 1) if row[i] == eos]
        logits = np.concatenate([np.asarray(model(jnp.asarray(row[a:b])[None], position_ids=jnp.arange(a, b)[None])
                                            .logits[0]) for a, b in zip(starts, starts[1:] + [len(row)])])
        log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        losses.extend(-log_probs[np.arange(len(row) - 1), row[1:]])
    assert first["loss"] == pytest.approx(float(np.mean(losses)), abs=1e-3)


@pytest.mark.slow
def test_a_vocabulary_that_is_not_the_runs_tokenizer_is_refused_before_training(tmp_path, tiny_artifact, tiny_mixture):
    write_hf_llama(tmp_path / "llama", vocab_size=300)  # the run's tokenizer has 512 entries
    _, out, proc = train_from(tmp_path / "llama", tmp_path / "run", tiny_artifact, tiny_mixture)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = (out / INPUT_ERROR_FILE).read_text().strip()
    assert line == (f"{tmp_path / 'llama'}/config.json: vocab_size 300 does not match the run's tokenizer "
                    "(512 entries)")
    assert not (out / METRICS_FILE).exists() and not (out / "checkpoints").exists()
