"""The code location loads through Dagster's own tooling, without the heavy ML stack."""

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # `dagster definitions validate` in its own process
def test_definitions_validate_passes(tmp_path):
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path), "MARIN_PREFIX": str(tmp_path / "store")}
    (tmp_path / "dagster.yaml").write_text((REPO / "dagster.yaml").read_text())
    proc = subprocess.run([str(Path(sys.executable).parent / "dagster"), "definitions", "validate", "-w",
                           str(REPO / "workspace.yaml")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "All code locations passed validation" in proc.stdout + proc.stderr


def test_loading_never_imports_jax_levanter_haliax_or_ray(tmp_path):
    probe = ("import sys, marin_assets.definitions as d; d.defs.resolve_asset_graph(); "
             "print(','.join(m for m in ('jax','levanter','haliax','ray','torch') if m in sys.modules))")
    env = {**os.environ, "MARIN_PREFIX": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == ""


@pytest.mark.slow  # a process loading the code location
def test_loading_never_touches_the_store(tmp_path):
    """The code location loads with its store on an S3 endpoint that records every connection: the
    dagster code server's load (definitions, asset graph, sensors and their partitions) opens none."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(conn.getpeername())
            conn.close()

    threading.Thread(target=accept, daemon=True).start()
    probe = ("import marin_assets.definitions as d; g = d.defs.resolve_asset_graph(); "
             "d.defs.get_repository_def().get_all_jobs(); print(len(g.get_all_asset_keys()))")
    env = {**os.environ, "MARIN_PREFIX": "s3://marin-unreachable/store", "DAGSTER_HOME": str(tmp_path),
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{listener.getsockname()[1]}", "AWS_ACCESS_KEY_ID": "x",
           "AWS_SECRET_ACCESS_KEY": "x", "AWS_EC2_METADATA_DISABLED": "true"}
    try:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=REPO,
                             timeout=300)
    finally:
        listener.close()
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 20
    assert connections == []


def test_every_asset_has_a_code_version_and_description():
    import marin_assets.definitions as d

    graph = d.defs.resolve_asset_graph()
    for key in graph.get_all_asset_keys():
        node = graph.get(key)
        assert node.code_version or node.is_observable, key  # a source's version is its observed listing
        assert node.description, key


def test_every_node_label_names_stage_and_subject_and_maps_back_to_its_marin_key():
    """The UI labels a node with the last key component: unique, naming stage and subject; every
    asset has a group, owners and kinds; the marin key (store path, CLI name) round-trips."""
    import marin_assets.definitions as d
    from marin_resources.keys import asset_key, marin_key, parse_selection

    graph = d.defs.resolve_asset_graph()
    keys = list(graph.get_all_asset_keys())
    labels = [k.path[-1] for k in keys]
    assert len(set(labels)) == len(labels), sorted(labels)
    for key in keys:
        node = graph.get(key)
        assert node.group_name != "default" and node.owners and node.kinds, key
        marin = marin_key(key)
        assert asset_key(marin) == key and parse_selection(marin) == key
        assert parse_selection(key.to_user_string()) == key  # the UI's spelling works on the CLI too
        if "/" in marin:
            stage, subject = marin.split("/")
            assert key.path[-1] == f"{subject}_{stage}"
    assert asset_key("filtered/shakespeare").path == ["filtered", "shakespeare_filtered"]
    assert marin_key(asset_key("checkpoint")) == "checkpoint"
