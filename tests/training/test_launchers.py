import sys

import pytest

from marin_assets.training.commands import eval_command, train_command
from marin_assets.training.levanter_config import render_train_config
from marin_resources.launchers import LocalPipesLauncher, build_command_and_env


def test_cpu_train_command_and_env():
    launch = build_command_and_env(train_command("/o/train_config.yaml", "/o"))
    assert launch.command == [sys.executable, "-m", "marin_assets.training.train_main", "--config",
                              "/o/train_config.yaml", "--output-dir", "/o"]
    assert launch.env["JAX_PLATFORMS"] == "cpu"
    assert launch.env["WANDB_MODE"] == "offline"
    assert launch.env["RAY_USAGE_STATS_ENABLED"] == "0"
    assert launch.env["HF_HUB_OFFLINE"] == "1"
    assert "WANDB_API_KEY" not in launch.env


def test_a_cpu_run_gets_its_device_count_as_virtual_devices():
    from marin_resources.placement import ResourceSpec

    assert "XLA_FLAGS" not in build_command_and_env(train_command("/o/c.yaml", "/o")).env
    launch = LocalPipesLauncher().launch(train_command("/o/c.yaml", "/o"), resources=ResourceSpec(device_count=8))
    assert launch.env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    # An accelerator's devices are real: the flag would only add CPU devices beside them.
    gpu = LocalPipesLauncher().launch(train_command("/o/c.yaml", "/o"),
                                      resources=ResourceSpec(accelerator="gpu", device_count=8))
    assert "XLA_FLAGS" not in gpu.env


def test_gpu_eval_with_wandb_key():
    launch = build_command_and_env(eval_command("/o/c.yaml", "/o", extra_args=["--max-examples", "4"]),
                                   accelerator="gpu", wandb_api_key="k")
    assert launch.command[2] == "marin_assets.training.eval_main"
    assert launch.command[-4:] == ["--output", "/o/eval_report.json", "--max-examples", "4"]
    assert launch.env["JAX_PLATFORMS"] == ""  # overrides an inherited "cpu" so JAX finds the GPU
    assert launch.env["WANDB_MODE"] == "online" and launch.env["WANDB_API_KEY"] == "k"


def test_resource_key_switches_wandb_online_and_stays_out_of_config(tmp_path, tiny_artifact, tiny_mixture):
    from conftest import tiny_spec

    from marin_assets.training.assets import launcher_wandb

    launcher = LocalPipesLauncher(wandb_api_key="secret-key", cpu_peak_flops=2e11)
    assert launcher_wandb(launcher, tiny_spec()).mode == "online"
    path = render_train_config(tiny_spec(), tiny_mixture, tiny_artifact[1], str(tmp_path),
                               launcher_wandb(launcher, tiny_spec()))
    text = open(path).read()
    assert "secret-key" not in text and "mode: online" in text
    assert launcher.launch(train_command(path, str(tmp_path))).env["MARIN_CPU_PEAK_FLOPS"] == "200000000000.0"
    assert launcher_wandb(LocalPipesLauncher(), tiny_spec()).mode == "offline"


@pytest.mark.slow  # launched processes
def test_output_to_file_keeps_process_output_in_the_run_and_quotes_it_on_failure(tmp_path):
    import dagster as dg
    import pytest

    missing_config = tmp_path / "no_such_config.yaml"

    @dg.asset
    def train(context: dg.AssetExecutionContext, launcher: LocalPipesLauncher):
        launcher.run_process(context, train_command(str(missing_config), str(tmp_path / "run")))

    with pytest.raises(dg.Failure) as info:
        dg.materialize([train], resources={"launcher": LocalPipesLauncher(output_to_file=True)})
    log_file = tmp_path / "run" / "train_output.log"
    logged = log_file.read_text()
    assert "no_such_config.yaml" in logged and "Traceback" in logged
    # The failure names the file and quotes its last lines.
    assert str(log_file) in info.value.description and "no_such_config.yaml" in info.value.description


def test_whole_lines_waits_for_the_newline_of_a_line_written_in_pieces(tmp_path):
    import threading

    from marin_resources.launchers import whole_lines

    path = tmp_path / "messages"
    path.write_text("")
    stop = threading.Event()
    seen = []
    reader = threading.Thread(target=lambda: seen.extend(whole_lines(str(path), stop.is_set, poll_seconds=0.001)))
    reader.start()
    with open(path, "a") as fh:
        for piece in ('{"method": "log", ', '"params": {"message": "half', ' and half"}}\n', '{"last": 1}'):
            fh.write(piece)
            fh.flush()
            threading.Event().wait(0.05)  # the reader polls many times between pieces
    stop.set()
    reader.join()
    # Dagster's readline() tail would have yielded '{"method": "log", ' alone and died in json.loads.
    assert seen == ['{"method": "log", "params": {"message": "half and half"}}\n', '{"last": 1}']


def test_harness_command_names_its_suite_and_report():
    from marin_assets.training.commands import harness_command

    launch = build_command_and_env(harness_command("/o/c.yaml", "/o/harness_config.json", "/o",
                                                   checkpoint_path="/ckpt/step-9"))
    assert launch.command[1:] == ["-m", "marin_assets.evaluation.harness_main", "--config", "/o/c.yaml",
                                  "--output", "/o/harness_report.json", "--harness", "/o/harness_config.json",
                                  "--checkpoint", "/ckpt/step-9"]
    assert launch.env["HF_HUB_OFFLINE"] == "1" and launch.env["JAX_PLATFORMS"] == "cpu"
