"""The demo chain on s3:// (moto_server) and gs:// (gcp-storage-emulator) prefixes, through `marin`
as a user runs it: curation, tokenizer, a Levanter cache Levanter reads from the bucket, training
whose checkpoints land in the bucket as they are saved, eval. On S3 also a kill -9 and a wiped
scratch, then resume from the bucket. Plus the one-line errors for a store that cannot be used."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import polars as pl
import pytest

from marin_resources.storage.object_stores import fix_kvstore, store_process_env

pytestmark = [pytest.mark.slow, pytest.mark.heaviest]

RUN = "tiny"
STEPS = 100
CHECKPOINT_EVERY = 10
RUNS_YAML = f"""runs:
  {RUN}:
    mixture: shakespeare
    tokenizer: shakespeare
    model: {{hidden_dim: 32, intermediate_dim: 64, num_layers: 2, num_heads: 2, num_kv_heads: 2, seq_len: 64}}
    optimizer: {{learning_rate: 0.01, warmup: 0.1, min_lr_ratio: 0.1}}
    train_batch_size: 8
    num_train_steps: {STEPS}
    steps_per_eval: 10000
    max_eval_batches: 2
    checkpoint_every: {CHECKPOINT_EVERY}
"""


def marin_process(env, cwd, *args, **popen):
    return subprocess.Popen([sys.executable, "-m", "marin_assets.cli", *args], env=env, cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def marin(env, cwd, *args, check=True, timeout=900):
    proc = marin_process(env, cwd, *args)
    out, err = proc.communicate(timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"marin {' '.join(args)} exited {proc.returncode}\n{out[-3000:]}\n{err[-5000:]}")
    return proc.returncode, out, err


def chain_env(root: Path, prefix: str, store_vars: dict) -> dict:
    """What a user sets: the store's standard variables and a prefix, no marin-specific flags."""
    texts = root / "texts"
    texts.mkdir()
    sys.path.insert(0, str(Path(__file__).parents[1] / "training"))
    import data_fixtures

    from marin_assets.curation.filters import FilterConfig, apply_filters

    docs = data_fixtures.stdlib_docstrings()
    # A text file is one document; validation takes about one in ten (by a hash of the id). Which
    # docstrings exist depends on what the process imported, so a group the source's filters would
    # drop (failing filtered's drop-fraction ERROR check for its one-document shard) is left out.
    groups = [pl.DataFrame({"id": [str(i)], "text": ["\n\n".join(docs[i:i + 40])], "source": ["s"],
                            "source_id": [str(i)], "metadata": ["{}"]}) for i in range(0, len(docs), 40)]
    kept = [g["text"][0] for g in groups if apply_filters(g, FilterConfig()).kept.height == 1]
    assert len(kept) >= 8, f"only {len(kept)} of {len(groups)} docstring groups pass the filters"
    for n, text in enumerate(kept):
        (texts / f"part{n:03d}.txt").write_text(text)
    (root / "sources.yaml").write_text(f"sources:\n  - name: shakespeare\n    uri: {texts}/*.txt\n    format: text\n")
    (root / "runs.yaml").write_text(RUNS_YAML)
    (root / "scratch").mkdir()
    (root / "cwd").mkdir()
    return {**os.environ, **store_vars, "MARIN_ENV": "local", "MARIN_PREFIX": prefix,
            "MARIN_SOURCES": str(root / "sources.yaml"), "MARIN_RUNS": str(root / "runs.yaml"),
            "DAGSTER_HOME": str(root / "home"),
            # Scratch: where staging directories go. Wiping it stands for moving to a fresh machine.
            "TMPDIR": str(root / "scratch"), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def s3_chain(s3_server, tmp_path_factory):
    import s3fs

    root = tmp_path_factory.mktemp("s3chain")
    bucket = f"chain-{uuid.uuid4().hex[:8]}"
    env = chain_env(root, f"s3://{bucket}/store", {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                                                   "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_server})
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_server}, key="testing", secret="testing",
                           skip_instance_cache=True)
    fs.mkdir(bucket)
    return {"env": env, "root": root, "cwd": root / "cwd", "fs": fs, "store": f"{bucket}/store"}


def at(fs, pattern: str) -> str | None:
    """The one path matching `pattern` (an identity directory is `v1-<fingerprint>`), or None."""
    found = fs.glob(pattern, refresh=True)
    assert len(found) <= 1, found
    return found[0] if found else None


def complete_steps(fs, checkpoints: str) -> list[int]:
    found = fs.glob(f"{checkpoints}/step-*/metadata.json", refresh=True)
    return sorted(int(p.split("/step-")[1].split("/")[0]) for p in found)


def test_s3_chain_killed_mid_training_resumes_from_the_bucket_on_a_fresh_scratch_then_evals(s3_chain):
    env, cwd, fs, store = s3_chain["env"], s3_chain["cwd"], s3_chain["fs"], s3_chain["store"]
    marin(env, cwd, "materialize", "mixture/shakespeare")
    # Levanter's own loader reads the cache from the bucket (what training does first).
    cache = f"s3://{at(fs, f'{store}/tokenized/shakespeare/v1-*')}/train"
    assert fs.exists(f"{cache[5:]}/input_ids/offsets/zarr.json"), fs.find(cache[5:])

    checkpoints = f"{store}/checkpoint/v1-*/{RUN}/checkpoints"  # a glob: the directory appears with training
    proc = marin_process(env, cwd, "materialize", "checkpoint", "--partition", RUN, start_new_session=True)
    deadline = time.monotonic() + 600
    while not complete_steps(fs, checkpoints):
        if proc.poll() is not None:
            raise AssertionError(f"training exited {proc.returncode} before a checkpoint:\n"
                                 f"{proc.communicate()[1][-6000:]}")
        assert time.monotonic() < deadline, "no checkpoint reached the bucket within 600 s"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    saved = complete_steps(fs, checkpoints)
    assert saved[-1] < STEPS - 1, "training finished before it could be killed"
    assert at(fs, f"{store}/checkpoint/v1-*/{RUN}/.artifact.json") is None
    # A fresh machine: nothing of the first attempt is left on local disk. Moved aside, not deleted:
    # wandb's service outlives the killed group for a moment and removes its own files meanwhile.
    os.rename(env["TMPDIR"], f"{env['TMPDIR']}-killed")
    os.mkdir(env["TMPDIR"])

    _, out, _ = marin(env, cwd, "materialize", "eval", "--partition", RUN)
    # The resumed training as the terminal shows it: where its process logs, then its steps.
    assert re.search(rf"checkpoint, eval \[{RUN}\]: train process output: .*/train_output\.log\n", out), out
    assert re.search(rf"checkpoint, eval \[{RUN}\]: step \d+/{STEPS} loss [\d.]+ tokens/s \d+", out), out
    manifest = json.loads(fs.cat(at(fs, f"{store}/checkpoint/v1-*/{RUN}/.artifact.json")))
    metrics = manifest["metrics"]
    # Killed between two saves: the resumed attempt starts right after the last step saved then.
    assert metrics["resumed_from_step"] == saved[-1] + 1, (saved, metrics)
    assert metrics["final_step"] == STEPS
    assert metrics["attempt"] == 1  # the first attempt's metrics came back from the bucket
    assert metrics["train_loss_last"] < metrics["train_loss_first"]
    files = {f["path"] for f in manifest["files"]}
    assert f"checkpoints/step-{STEPS - 1}/metadata.json" in files and "metrics.jsonl" in files
    assert f"checkpoints/step-{saved[-1]}/metadata.json" in files
    evaluation = json.loads(fs.cat(at(fs, f"{store}/eval/v1-*/{RUN}/.artifact.json")))["metrics"]
    assert math.isfinite(evaluation["eval/shakespeare/bpb"]) and evaluation["eval/shakespeare/tokens"] > 0

    code, _, err = marin(env, cwd, "lineage", "eval", "--partition", RUN, "--verify")
    assert "verified" in err
    # Nothing reached local disk outside scratch (JAX once turned s3://b/x into ./s3:/b/x).
    assert list(cwd.iterdir()) == []
    assert not any(Path(env["TMPDIR"]).iterdir())


def test_gcs_chain_trains_in_the_bucket_and_evals(gcs_tensorstore_server, tmp_path):
    import gcsfs

    bucket = f"chain-{uuid.uuid4().hex[:8]}"
    env = chain_env(tmp_path, f"gs://{bucket}/store", {"STORAGE_EMULATOR_HOST": gcs_tensorstore_server})
    fs = gcsfs.GCSFileSystem(endpoint_url=gcs_tensorstore_server, token="anon", skip_instance_cache=True)
    fs.mkdir(bucket)
    store = f"{bucket}/store"
    marin(env, tmp_path / "cwd", "materialize", "eval", "--partition", RUN)
    metrics = json.loads(fs.cat(at(fs, f"{store}/checkpoint/v1-*/{RUN}/.artifact.json")))["metrics"]
    assert metrics["resumed_from_step"] == 0 and metrics["attempt"] == 0 and metrics["final_step"] == STEPS
    assert complete_steps(fs, f"{store}/checkpoint/v1-*/{RUN}/checkpoints")[-1] == STEPS - 1
    assert at(fs, f"{store}/tokenized/shakespeare/v1-*/train/input_ids/offsets/zarr.json")
    evaluation = json.loads(fs.cat(at(fs, f"{store}/eval/v1-*/{RUN}/.artifact.json")))["metrics"]
    assert math.isfinite(evaluation["eval/shakespeare/bpb"])
    assert list((tmp_path / "cwd").iterdir()) == []


def test_the_s3_kvstore_gets_the_bucket_path_and_endpoint():
    spec = {"driver": "zarr3", "kvstore": {"driver": "gcs", "bucket": "b", "path": "x/y"}}
    fixed = fix_kvstore(spec, "s3://b/x/y", "http://127.0.0.1:9000")
    assert fixed["kvstore"]["driver"] == "s3" and fixed["kvstore"]["bucket"] == "b"
    assert fixed["kvstore"]["path"] == "x/y" and fixed["kvstore"]["endpoint"] == "http://127.0.0.1:9000"
    assert fixed["kvstore"]["context"]["s3_request_retries"]["max_retries"] >= 1
    ocdbt = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "path": "y", "base": {"driver": "gcs", "bucket": "b",
                                                                                   "path": "x"}}}
    assert fix_kvstore(ocdbt, "s3://b/x/y", None)["kvstore"]["base"]["driver"] == "s3"
    gs = fix_kvstore({"driver": "zarr3", "kvstore": {"driver": "gcs", "bucket": "b", "path": "x"}}, "gs://b/x",
                     "http://ignored")["kvstore"]
    assert gs["driver"] == "gcs" and "endpoint" not in gs and "gcs_request_retries" in gs["context"]
    local = {"driver": "zarr3", "kvstore": {"driver": "file", "path": "/x"}}
    assert fix_kvstore(local, "/x", None)["kvstore"] == {"driver": "file", "path": "/x"}


def test_jax_s3_specs_go_to_the_bucket_not_a_local_path():
    """JAX 0.7 alone turns s3://b/x into the local file path s3:/b/x."""
    from marin_resources.storage.object_stores import install_tensorstore_paths

    install_tensorstore_paths()
    import jax.experimental.array_serialization.serialization as serialization

    kvstore = serialization.get_tensorstore_spec("s3://bucket/a/b", ocdbt=False)["kvstore"]
    assert kvstore["driver"] == "s3" and kvstore["bucket"] == "bucket" and kvstore["path"] == "a/b"


def test_the_cache_writers_kvstore_is_the_one_jax_builds(monkeypatch):
    """The token cache is written without JAX (tensorstore_kvstore); Levanter reads it through JAX's
    spec, as install_tensorstore_paths fixes it. Both must name the same objects."""
    from marin_resources.storage.object_stores import install_tensorstore_paths, tensorstore_kvstore

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    install_tensorstore_paths()
    import jax.experimental.array_serialization.serialization as serialization

    for url in ("s3://bucket/store/tokenized/x/v1/train/input_ids/data", "gs://bucket/a/b/", "/tmp/cache/offsets"):
        assert tensorstore_kvstore(url) == serialization.get_tensorstore_spec(url, ocdbt=False)["kvstore"], url
    with pytest.raises(ValueError, match="bucket and a path"):
        tensorstore_kvstore("s3://bucket")


def test_processes_get_the_store_location_and_tensorstore_the_gcs_emulator():
    env = store_process_env({"AWS_ENDPOINT_URL": "http://s3", "STORAGE_EMULATOR_HOST": "http://gcs",
                             "AWS_SECRET_ACCESS_KEY": "secret", "HOME": "/root"})
    assert env == {"AWS_ENDPOINT_URL": "http://s3", "STORAGE_EMULATOR_HOST": "http://gcs",
                   "TENSORSTORE_GCS_HTTP_URL": "http://gcs"}


# (gcs-unreachable takes gcsfs's own six tries, about 30 s, through the same code path as s3-unreachable.)
@pytest.mark.parametrize("case", ["s3-missing-bucket", "s3-unreachable", "s3-wrong-credentials", "gcs-missing-bucket"])
def test_a_store_that_cannot_be_used_is_one_line_naming_it(case, request, tmp_path):
    kind, fault = case.split("-", 1)
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST")}
    env.update({"MARIN_ENV": "local", "DAGSTER_HOME": str(tmp_path / "home"), "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"})
    if fault == "unreachable":
        endpoint = "http://127.0.0.1:9"
    elif fault == "wrong-credentials":
        endpoint = request.getfixturevalue("s3_server_checking_credentials")
    else:
        endpoint = request.getfixturevalue("s3_server" if kind == "s3" else "gcs_server")
    env["AWS_ENDPOINT_URL" if kind == "s3" else "STORAGE_EMULATOR_HOST"] = endpoint
    prefix = f"{'s3' if kind == 's3' else 'gs'}://absent-{uuid.uuid4().hex[:8]}/store"
    env["MARIN_PREFIX"] = prefix
    code, out, err = marin(env, tmp_path, "status", check=False, timeout=300)
    assert code == 2, (out, err)
    assert err.count("\n") == 1 and err.startswith(f"marin: store {prefix}: ") and endpoint in err, err
    expected = {"missing-bucket": "does not exist", "unreachable": "cannot reach",
                "wrong-credentials": "refused; check the credentials"}[fault]
    assert expected in err, err
    if kind == "s3" and fault == "missing-bucket":
        import s3fs

        fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, key="testing", secret="testing",
                               skip_instance_cache=True)
        assert not fs.exists(prefix.split("://")[1].split("/")[0])  # not created behind the user's back
