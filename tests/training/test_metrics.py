import json
from pathlib import Path

import pytest
from conftest import tiny_spec

from marin_assets.training.metrics import (
    mfu,
    peak_flops_per_device,
    peak_flops_total,
    plot_loss_curve,
    read_metrics,
    training_flops_per_token,
)


def test_flops_per_token_matches_the_scaling_library():
    from scaling.flops import training_flops_per_token as scaling_flops

    model = tiny_spec().model
    vocab = 512
    expected = scaling_flops(hidden_dim=model.hidden_dim, intermediate_dim=model.intermediate_dim,
                             num_layers=model.num_layers, num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                             vocab_size=vocab, seq_len=model.seq_len)
    assert training_flops_per_token(model, vocab) == expected
    n_matmul = model.parameter_count(vocab) - vocab * model.hidden_dim - model.hidden_dim * (2 * model.num_layers + 1)
    assert training_flops_per_token(model, vocab) > 6 * n_matmul  # matmuls plus attention


def test_peak_flops_lookup(monkeypatch):
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_per_device("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_per_device("TPU v5 lite") == 197e12
    assert peak_flops_per_device("mystery chip") is None
    monkeypatch.setenv("MARIN_CPU_PEAK_FLOPS", "1e11")
    assert peak_flops_per_device("cpu") == 1e11
    # Eight H100s have eight peaks; eight virtual CPU devices share their host's one (one host per process).
    assert peak_flops_total("NVIDIA H100 80GB HBM3", 8, 1) == 8 * 989e12
    assert peak_flops_total("cpu", 8, 1) == 1e11 and peak_flops_total("cpu", 8, 2) == 2e11
    assert peak_flops_total("mystery chip", 8, 1) is None
    assert mfu(1000.0, 1e6, 1e11) == pytest.approx(0.01)


def test_read_metrics_keeps_last_record_per_step_and_skips_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [
        {"step": 0, "loss": 5.0, "attempt": 0},
        {"step": 1, "loss": 4.5, "attempt": 0},
        {"step": 1, "loss": 4.4, "attempt": 1},
        {"step": 2, "loss": 4.0, "attempt": 1, "eval/loss": 4.2},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 3, "lo')
    records = read_metrics(path)
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[1]["attempt"] == 1
    png = plot_loss_curve(path, tmp_path / "loss.png", title="t")
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert png.endswith("loss.png")


def test_the_checkpoint_shows_the_loss_curve_it_committed_on_every_event(tmp_path):
    """`checkpoint_display` reads the plot from the committed artifact, so a materialization that
    reuses the checkpoint (the export's run) shows it as the build's did."""
    import base64

    from marin_assets.training.assets import checkpoint_display
    from marin_assets.training.train_main import LOSS_CURVE_FILE
    from marin_resources.storage.store import ArtifactStore, producer_info, writing

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": i, "loss": 5.0 - i / 10}) + "\n" for i in range(20)))
    png = Path(plot_loss_curve(metrics, tmp_path / "loss.png", title="t")).read_bytes()
    store, spec = ArtifactStore(str(tmp_path / "store")), tiny_spec()
    manifests = {}
    for partition, files in (("plotted", {LOSS_CURVE_FILE: png}), ("unplotted", {})):
        with writing(store, "checkpoint", "v1", partition, fingerprint="f" * 64, run_id="t") as writer:
            for name, data in {"metrics.jsonl": metrics.read_bytes(), **files}.items():
                with writer.open(name) as fh:
                    fh.write(data)
            manifests[partition] = writer.commit(config={}, upstream=[], producer=producer_info("t"))

    shown = checkpoint_display(store, manifests["plotted"], spec, None)
    assert shown["loss_curve"].value == f"![loss curve of tiny](data:image/png;base64,{base64.b64encode(png).decode()})"
    assert (shown["run"], shown["model_family"]) == ("tiny", spec.model.family) and "init_from" not in shown
    assert "loss_curve" not in checkpoint_display(store, manifests["unplotted"], spec, None)
