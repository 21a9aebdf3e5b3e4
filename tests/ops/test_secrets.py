"""Planted secret values never reach manifests, metadata or logs."""

import json

import dagster as dg

from marin_resources.artifact_spec import ArtifactSpec
from marin_resources.artifacts import ArtifactHandleIOManager, Built, MarinStore, marin_asset, materialize_artifact
from marin_resources.storage.secrets import REDACTED, scrub, secret_values

PLANTED = {"WANDB_API_KEY": "wandb-planted-0123456789", "HF_TOKEN": "hf_plantedTOKENvalue42",
           "AWS_SECRET_ACCESS_KEY": "aws/planted+secret/key"}


def test_scrub_replaces_secret_values_everywhere():
    secrets = list(PLANTED.values())
    obj = {"a": f"token={PLANTED['HF_TOKEN']}", "b": [PLANTED["WANDB_API_KEY"], 3],
           "c": dg.MetadataValue.json({"k": PLANTED["AWS_SECRET_ACCESS_KEY"]})}
    out = scrub(obj, secrets)
    assert out["a"] == f"token={REDACTED}" and out["b"] == [REDACTED, 3]
    assert out["c"].data == {"k": REDACTED}


def test_the_ray_clusters_token_is_a_secret_too():
    """RAY_AUTH_TOKEN admits anyone to a token-auth Ray cluster (docs/scaling-out.md): scrubbed like the others."""
    token = "ray-planted-token-0123"
    assert scrub({"env": f"RAY_AUTH_TOKEN={token}"}, secret_values({"RAY_AUTH_TOKEN": token})) == \
        {"env": f"RAY_AUTH_TOKEN={REDACTED}"}


def test_planted_secrets_do_not_reach_manifest_metadata_or_logs(tmp_path, monkeypatch):
    for key, value in PLANTED.items():
        monkeypatch.setenv(key, value)

    import os

    # A careless producer that puts the environment into its config and metrics.
    spec = ArtifactSpec("leaky/asset", "v1", lambda _partition: {
        "env_key": os.environ["WANDB_API_KEY"], "url": f"https://x?token={os.environ['HF_TOKEN']}"})

    @marin_asset(spec)
    def leaky(context: dg.AssetExecutionContext, store: MarinStore):

        def build(w):
            with w.open("out.txt") as fh:
                fh.write(b"data")
            return Built(metrics={"note": os.environ["AWS_SECRET_ACCESS_KEY"]},
                         metadata={"auth": os.environ["HF_TOKEN"]})
        return materialize_artifact(context, store, spec, upstream=[], build=build)

    store = MarinStore(prefix=str(tmp_path))
    with dg.instance_for_test() as instance:
        result = dg.materialize([leaky], instance=instance, resources={
            "store": store, "artifact_io_manager": ArtifactHandleIOManager(store=store)})
        assert result.success
        logs = json.dumps([str(e.dagster_event) + str(e.user_message) for e in instance.all_logs(result.run_id)])
    manifest_text = next(tmp_path.glob("leaky/asset/v1-*/.artifact.json")).read_text()
    for value in PLANTED.values():
        assert value not in manifest_text
        assert value not in logs
    assert REDACTED in manifest_text
