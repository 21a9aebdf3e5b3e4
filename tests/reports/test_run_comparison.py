"""`marin compare` and `reports/run_comparison` on synthetic committed artifacts: the table, the
loss curves, refusals, and the cross-eval pieces that need no training (the tokenizer check, the
validation-only config)."""

import json
from dataclasses import replace

import dagster as dg
import pytest
import yaml

from marin_assets.cli import main
from marin_assets.deployment import Deployment
from marin_assets.evaluation.cross_eval import tokenizer_mismatch
from marin_assets.reports.compare import (
    CompareError,
    cell_text,
    compare,
    loss_curves,
    markdown_table,
    plot_loss_curves,
    text_table,
)
from marin_assets.reports.comparison import build_run_comparison_asset, load_runs
from marin_assets.stages import build_catalog
from marin_assets.training.levanter_config import validation_only_config
from marin_assets.training.spec import ModelSpec, OptimizerSpec, RunSpec
from marin_resources.environments import MarinSettings, build_resources
from marin_resources.storage.identity import fingerprint
from marin_resources.storage.store import ArtifactStore, Manifest, UpstreamRef, producer_info, writing

RUNS_YAML = """
runs:
  small: &run
    mixture: shakespeare
    tokenizer: shakespeare
    model: {hidden_dim: 32, intermediate_dim: 64, num_layers: 2, num_heads: 2, num_kv_heads: 2, seq_len: 64}
    optimizer: {learning_rate: 0.01}
    train_batch_size: 8
    num_train_steps: 10
  wide:
    <<: *run
    train_batch_size: 16
  untrained:
    <<: *run
"""


def commit(store: ArtifactStore, key: str, partition: str, *, config, metrics, files=None, upstream=()) -> Manifest:
    with writing(store, key, "v1", partition, fingerprint=fingerprint(config), run_id="test") as writer:
        for name, data in (files or {}).items():
            with writer.open(name) as fh:
                fh.write(data.encode())
        return writer.commit(config=config, upstream=list(upstream), producer=producer_info("test"), metrics=metrics)


def metrics_jsonl(losses, eval_every: int = 5) -> str:
    return "".join(json.dumps({"step": i, "loss": loss, **({"eval/loss": loss + 0.1} if (i + 1) % eval_every == 0
                                                         else {})}) + "\n"
                   for i, loss in enumerate(losses))


def train(store, run: str, batch: int, losses, *, metrics=None) -> Manifest:
    config = {"name": run, "mixture": "shakespeare", "tokenizer": "shakespeare", "train_batch_size": batch,
              "model": {"seq_len": 64}}
    return commit(store, "checkpoint", run, config=config, files={"metrics.jsonl": metrics_jsonl(losses)},
                  metrics={"final_step": len(losses), "train_loss_last": losses[-1], "parameter_count": 2_098_304,
                           **(metrics or {})})


def evaluate(store, key: str, run: str, checkpoint: Manifest, metrics) -> Manifest:
    return commit(store, key, run, config={"run": run, "key": key}, metrics=metrics,
                  upstream=[UpstreamRef("checkpoint", run, checkpoint.data_version, checkpoint.uri)])


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    runs = tmp_path / "runs.yaml"
    runs.write_text(RUNS_YAML)
    monkeypatch.setenv("MARIN_PREFIX", str(tmp_path / "store"))
    monkeypatch.setenv("MARIN_RUNS", str(runs))
    monkeypatch.chdir(tmp_path)
    return Deployment.load(MarinSettings.from_env())


@pytest.fixture
def specs(deployment):
    return build_catalog(MarinSettings.from_env(), deployment)


@pytest.fixture
def store(tmp_path, deployment):
    """`small` and `wide` trained and evaluated (`wide` with an eval of its previous checkpoint)."""
    store = ArtifactStore(str(tmp_path / "store"))
    small = train(store, "small", 8, [6.0, 5.0, 4.5, 4.2, 4.0, 3.9, 3.8, 3.7, 3.6, 3.5])
    evaluate(store, "eval", "small", small, {"eval/shakespeare/loss": 3.6, "eval/shakespeare/bpb": 1.9,
                                             "eval/shakespeare/tokens": 1000})
    evaluate(store, "harness_eval", "small", small, {"word_order/acc": 0.935, "word_order/acc_stderr": 0.0123,
                                                     "word_order/chance": 0.25, "eval/shakespeare/bpb": 1.95})
    evaluate(store, "cross_eval/installed_packages", "small", small,
             {"eval/installed_packages/loss": 6.5, "eval/installed_packages/bpb": 3.1})
    before = train(store, "wide", 16, [6.0, 5.5, 5.0])
    evaluate(store, "eval", "wide", before, {"eval/shakespeare/loss": 4.9, "eval/shakespeare/bpb": 2.6})
    train(store, "wide", 16, [6.0, 4.8, 4.1, 3.7, 3.4], metrics={"train_seconds": 12.5})
    return store


def test_the_table_has_a_column_per_run_and_a_row_per_metric_either_has(deployment, store, specs):
    results = load_runs(deployment, store, specs, ["small", "wide"])
    comparison = compare(results)
    rows = dict(comparison.rows)
    assert comparison.runs == ("small", "wide")
    assert rows["tokens trained"] == (10 * 8 * 64, 5 * 16 * 64)
    assert rows["final train loss"] == (3.5, 3.4)
    assert rows["train seconds"] == (None, 12.5)
    # eval's bits-per-byte wins over the harness's for the same set; cross_eval adds its own set.
    assert rows["eval shakespeare bpb"] == (1.9, None)
    assert rows["eval installed_packages loss"] == (6.5, None)
    assert rows["word_order acc"] == ("0.9350 ± 0.0123", None)
    assert rows["word_order margin"][0] == pytest.approx(0.935 - 2 * 0.0123 - 0.25)
    assert "tokens/s" not in rows  # a row no run has is left out
    # wide's eval read the checkpoint before its retraining: not shown, and said so.
    assert rows["eval shakespeare loss"] == (3.6, None)
    assert comparison.notes == ("eval[wide] evaluated an earlier checkpoint of the run; left out "
                                "(marin materialize eval --partition wide)",)

    text = text_table(comparison).splitlines()
    assert text[0].split() == ["metric", "small", "wide"]
    assert text[2].split() == ["mixture", "shakespeare", "shakespeare"]
    lines = {line.rsplit(None, 2)[0].strip(): line.split()[-2:] for line in text[2:]}
    assert lines["parameters"] == ["2,098,304", "2,098,304"] and lines["eval shakespeare loss"] == ["3.6000", "-"]
    assert len({len(line) for line in text}) == 1  # every column right-aligned to its width
    assert [cell_text(v) for v in (None, 2_098_304, 3.14159, 639.93, 12_345.6, "m")] == \
        ["-", "2,098,304", "3.1416", "639.9", "12,346", "m"]
    markdown = markdown_table(comparison).splitlines()
    assert markdown[:2] == ["| metric | small | wide |", "|---|---:|---:|"]
    assert "| word_order acc | 0.9350 ± 0.0123 | - |" in markdown


def test_each_row_reads_on_one_scale():
    # A row's numbers share their decimals, set by its largest: not "1,090" beside "94.5979".
    comparison = compare([])
    rows = (("train seconds", (1090.2, 94.5979)), ("tokens/s", (639.93, 2290.0)),
            ("eval shakespeare loss", (5.13157, 6.5)), ("steps", (300, None)), ("optimizer.epsilon", (1e-08, 1e-15)))
    text = text_table(replace(comparison, runs=("a", "b"), rows=rows)).splitlines()
    assert [line.split()[-2:] for line in text[2:]] == [["1,090", "95"], ["640", "2,290"], ["5.1316", "6.5000"],
                                                        ["300", "-"], ["1.00e-08", "1.00e-15"]]
    assert "| train seconds | 1,090 | 95 |" in markdown_table(replace(comparison, runs=("a", "b"), rows=rows))


def test_the_table_shows_initial_weights_and_every_config_field_the_runs_differ_on(deployment, store, specs):
    # `untrained` continues from small's export, on a made-up field no row knows: it is shown as it is.
    config = {"name": "untrained", "mixture": "shakespeare", "tokenizer": "shakespeare", "train_batch_size": 8,
              "model": {"seq_len": 64}, "init_from": {"run": "small", "sha256": "ab" * 32},
              "phases": [{"step": 0, "weights": {"shakespeare": 1.0}}, {"step": 5, "weights": {"other": 1.0}}]}
    commit(store, "checkpoint", "untrained", config=config, files={"metrics.jsonl": metrics_jsonl([5.0, 4.0])},
           metrics={"final_step": 2, "train_loss_last": 4.0})
    comparison = compare(load_runs(deployment, store, specs, ["small", "wide", "untrained"]))
    rows = dict(comparison.rows)
    assert rows["init from"] == (None, None, f"run small (sha256 {'ab' * 6})")
    assert rows["train_batch_size"] == (8, 16, 8)
    assert rows["phases"] == (None, None, config["phases"])
    assert "model.seq_len" not in rows and "name" not in rows  # the same in every run; each run's own name
    labels = [label for label, _ in comparison.rows]
    assert labels[:5] == ["mixture", "tokenizer", "init from", "train_batch_size", "phases"]  # set-up first
    line = next(line for line in text_table(comparison).splitlines() if line.startswith("phases"))
    assert line.split()[-1] == '[{"step":0,"weights":{"shakespeare":1.0}},{"step":5,"weights":{"other":1.0}}]'


def test_curves_line_up_by_tokens_and_are_drawn_on_one_plot(deployment, store, specs, tmp_path):
    results = load_runs(deployment, store, specs, ["small", "wide"])
    x_label, curves = loss_curves(results)
    assert x_label == "tokens trained"
    small, wide = curves
    assert small.x[:2] == [512, 1024] and wide.x[:2] == [1024, 2048]  # batch 8 vs 16 of 64-token sequences
    assert small.eval_x == [5 * 512, 10 * 512] and small.eval_loss == pytest.approx([4.1, 3.6])
    results[1].tokens_per_step = None
    assert loss_curves(results)[0] == "step"
    png = plot_loss_curves(results, tmp_path / "curves.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    for result in results:
        result.curve = []
    with pytest.raises(ValueError, match="no loss curve"):
        loss_curves(results)


def test_unknown_and_untrained_runs_are_refused_in_one_line(deployment, store, specs):
    with pytest.raises(CompareError, match=r"^unknown run 'nope': neither a named run \(small, untrained, wide\) "
                                           r"nor a run of a sweep"):
        load_runs(deployment, store, specs, ["small", "nope"])
    with pytest.raises(CompareError, match=r"^run 'untrained' has no committed checkpoint in .*: train it first "
                                           r"\(marin materialize eval --partition untrained\)$"):
        load_runs(deployment, store, specs, ["untrained"])


def test_marin_compare_prints_the_table_and_writes_the_plot(store, tmp_path, capsys):
    assert main(["compare", "small", "wide", "--plot", str(tmp_path / "out.png")]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[0].split() == ["metric", "small", "wide"]
    assert f"loss curves: {tmp_path / 'out.png'}" in out and (tmp_path / "out.png").stat().st_size > 0
    assert "note: eval[wide] evaluated an earlier checkpoint" in err
    assert main(["compare", "small", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["runs"] == ["small"] and body["plot"] == str(tmp_path / "compare.png")
    assert {"metric": "final train loss", "values": {"small": 3.5}} in body["rows"]
    for runs, line in ((["small", "nope"], "marin: unknown run 'nope'"),
                       (["untrained"], "marin: run 'untrained' has no committed checkpoint")):
        assert main(["compare", *runs]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(line) and err.count("\n") == 1


def test_the_comparison_asset_shows_the_table_and_the_plot(deployment, store, specs):
    asset = build_run_comparison_asset(deployment, specs)
    resources = {"store": build_resources(MarinSettings.from_env())["store"]}
    with dg.instance_for_test() as instance:
        result = dg.materialize([asset], instance=instance, resources=resources)
        [event] = result.asset_materializations_for_node(asset.node_def.name)
        metadata = event.metadata
        # By default every named run with a checkpoint: untrained has none.
        assert metadata["runs"].value == ["small", "wide"]
        assert "| final train loss | 3.5000 | 3.4000 |" in metadata["table"].value
        assert metadata["loss_curves"].value.startswith("![loss curves of small, wide](data:image/png;base64,")
        assert "earlier checkpoint" in metadata["notes"].value
        refused = dg.materialize([asset], instance=instance, resources=resources, raise_on_error=False,
                                 run_config={"ops": {asset.node_def.name: {"config": {"runs": ["untrained"]}}}})
        assert not refused.success


def spec(tokenizer: str) -> RunSpec:
    return RunSpec(name="r", model=ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=2,
                                             num_kv_heads=2, seq_len=64),
                   mixture="m", tokenizer=tokenizer, optimizer=OptimizerSpec(learning_rate=0.01), train_batch_size=8,
                   num_train_steps=10)


def built_with(tokenizer_version: str) -> Manifest:
    return Manifest("x", None, "v1", "f", {}, "dv", [], [UpstreamRef("tokenizer/t", None, tokenizer_version, "u")],
                    {}, "", "")


def test_a_tokenizer_mismatch_is_one_line_by_name_or_by_version():
    assert tokenizer_mismatch(spec("t"), built_with("a" * 16), "src", "t", built_with("a" * 16)) is None
    assert tokenizer_mismatch(spec("t"), None, "src", "t", built_with("a" * 16)) is None  # nothing to compare
    assert tokenizer_mismatch(spec("u"), None, "src", "t", None) == (
        "tokenized/src is tokenized with tokenizer/t, run 'r' was trained with tokenizer/u: loss and "
        "bits-per-byte across vocabularies mean nothing")
    assert tokenizer_mismatch(spec("t"), built_with("a" * 16), "src", "t", built_with("b" * 16)) == (
        "run 'r' was trained with tokenizer/t at data version aaaaaaaaaaaa, tokenized/src was built with it at "
        "bbbbbbbbbbbb: rebuild one of them so both use the same tokenizer")


def test_the_validation_only_config_reads_only_the_given_caches():
    run = {"data": {"tokenizer": "/tok", "cache_dir": "/mix", "shuffle": True,
                    "configs": {"own": {"cache_dir": "/own"}}, "train_weights": {"own": 1.0}},
           "model": {"type": "llama"}, "trainer": {"checkpointer": {"base_path": "/ckpt"}}}
    config = validation_only_config(yaml.safe_dump(run), {"new": "/store/tokenized/new"})
    assert config["data"] == {"tokenizer": "/tok", "shuffle": True, "train_weights": {"new": 1.0},
                              "configs": {"new": {"cache_dir": "/store/tokenized/new", "train_urls": [],
                                                  "validation_urls": []}}}
    assert config["model"] == run["model"] and config["trainer"] == run["trainer"]
