"""st_weince.training.processes' process count (read by prepare_trainer and the recipes): the processes a launcher
asked for against those that train,
with the environment each launcher gives its processes (as observed with accelerate 1.16 and torch 2.14's torchrun)."""

from __future__ import annotations

import json

import pytest

import st_weince.training.processes as processes_module
from st_weince.training.processes import count_processes

from recipe_tools import write_run_outputs

SCRIPT_ARGV = ["recipes/simcse.py", "--preset", "cpu-demo"]
# What `torchrun --nproc_per_node 2` sets in rank 0 (besides TORCHELASTIC_ERROR_FILE and its signals)
TORCHRUN_RANK0 = {
    "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "GROUP_RANK": "0",
    "GROUP_WORLD_SIZE": "1", "ROLE_RANK": "0", "ROLE_WORLD_SIZE": "2", "ROLE_NAME": "default",
    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29611", "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
}  # fmt: skip
# What `accelerate launch --cpu --num_processes 2` sets in the one process it starts (its simple launcher);
# MASTER_ADDR and MASTER_PORT only because --num_processes is above 1. No WORLD_SIZE, and no variable holds the 2.
ACCELERATE_CPU_TWO = {
    "ACCELERATE_USE_CPU": "True", "ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_DYNAMO_BACKEND": "NO",
    "ACCELERATE_DYNAMO_MODE": "default", "ACCELERATE_DYNAMO_USE_FULLGRAPH": "False",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "False", "KMP_AFFINITY": "granularity=fine,compact,1,0",
    "KMP_BLOCKTIME": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "OMP_NUM_THREADS": "1",
}  # fmt: skip
# ... and its own command line, the parent of that process (/proc/<ppid>/cmdline)
ACCELERATE_CPU_TWO_ARGV = ["python3", "/usr/bin/accelerate", "launch", "--cpu", "--num_processes", "2", *SCRIPT_ARGV]
LAUNCHER_VARIABLES = {*TORCHRUN_RANK0, *ACCELERATE_CPU_TWO, *processes_module.MPI_SIZE_VARIABLES}


@pytest.fixture
def launched(monkeypatch):
    """Set the environment as a launcher sets it, in a process that starts without any launcher's variables."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def launch(variables: dict[str, str]) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return launch


def test_torchrun_two_processes_no_warning(launched):
    launched(TORCHRUN_RANK0)
    count = count_processes(2, gpus=0, argv=SCRIPT_ARGV)
    assert (count.launcher, count.requested, count.actual, count.warning) == ("torchrun", 2, 2, None)
    assert count.summary == "training on 2 processes (world size 2, rank 0 prints)"
    assert count.record() == {"launcher": "torchrun", "requested": 2, "actual": 2}


def test_accelerate_launch_on_a_cpu_runs_one_of_two_and_names_torchrun(launched):
    launched(ACCELERATE_CPU_TWO)
    count = count_processes(1, gpus=0, launcher_argv=ACCELERATE_CPU_TWO_ARGV, argv=SCRIPT_ARGV)
    assert (count.launcher, count.requested, count.actual) == ("accelerate launch", 2, 1)
    assert count.summary == "training on 1 process (world size 1)"
    assert count.warning.startswith("accelerate launch asked for 2 processes, but this run trains on 1")
    # issue 53: accelerate launch --multi_gpu does start several CPU processes (not only MPI), with use_cpu=True
    assert "MPI" not in count.warning
    assert "use_cpu=True" in count.warning and "only with --multi_gpu (with --cpu it starts one)" in count.warning
    assert count.warning.endswith("\n    torchrun --nproc_per_node 2 recipes/simcse.py --preset cpu-demo")
    # On a machine with GPUs the command that works is accelerate's own, with --multi_gpu.
    on_gpus = count_processes(1, gpus=2, launcher_argv=ACCELERATE_CPU_TWO_ARGV, argv=SCRIPT_ARGV)
    assert on_gpus.warning.endswith(
        "\n    accelerate launch --multi_gpu --num_processes 2 recipes/simcse.py --preset cpu-demo"
    )
    one_gpu = count_processes(1, gpus=1, launcher_argv=ACCELERATE_CPU_TWO_ARGV, argv=SCRIPT_ARGV)
    assert "one process per GPU with --multi_gpu (this machine has 1)" in one_gpu.warning


def test_accelerate_count_is_read_from_the_launchers_options_only(launched):
    launched(ACCELERATE_CPU_TWO)
    equals = ["accelerate", "launch", "--num-processes=3", *SCRIPT_ARGV, "--num_processes", "5"]  # 5: the script's
    assert count_processes(1, gpus=0, launcher_argv=equals, argv=SCRIPT_ARGV).requested == 3
    # The launcher's command line unreadable (or a config file's --num_processes): more than one, count unknown.
    unknown = count_processes(1, gpus=0, launcher_argv=[], argv=SCRIPT_ARGV)
    assert unknown.requested is None
    assert "asked for more than one process (--num_processes), but this run trains on 1" in unknown.warning
    assert unknown.warning.endswith("torchrun --nproc_per_node N recipes/simcse.py --preset cpu-demo")


def test_one_process_asked_for_one_run_no_warning(launched):
    assert count_processes(1, gpus=0, argv=SCRIPT_ARGV).record() == {"launcher": "python", "requested": 1, "actual": 1}
    # accelerate launch --cpu (one process): no MASTER_ADDR, no --num_processes above 1
    launched({k: v for k, v in ACCELERATE_CPU_TWO.items() if not k.startswith("MASTER_")})
    single = count_processes(1, gpus=0, launcher_argv=["accelerate", "launch", "--cpu", *SCRIPT_ARGV], argv=SCRIPT_ARGV)
    assert (single.launcher, single.requested, single.warning) == ("accelerate launch", 1, None)


def test_mpirun_count(launched):
    launched({"PMI_SIZE": "2", "ACCELERATE_USE_CPU": "True"})
    assert count_processes(2, gpus=0, argv=SCRIPT_ARGV).warning is None
    assert count_processes(1, gpus=0, argv=SCRIPT_ARGV).warning.startswith("mpirun asked for 2 processes")


def test_announce_prints_summary_and_warning(launched, capsys):
    launched(ACCELERATE_CPU_TWO)
    count_processes(1, gpus=0, launcher_argv=ACCELERATE_CPU_TWO_ARGV, argv=SCRIPT_ARGV).announce()
    out, err = capsys.readouterr()
    assert out == "training on 1 process (world size 1)\n"
    assert err.startswith("warning: accelerate launch asked for 2 processes") and "torchrun --nproc_per_node 2" in err


def test_results_json_records_requested_and_actual_beside_world_size(launched, tmp_path):
    launched(ACCELERATE_CPU_TWO)
    count = count_processes(1, gpus=0, launcher_argv=ACCELERATE_CPU_TWO_ARGV, argv=SCRIPT_ARGV)
    write_run_outputs(tmp_path, {"steps": 1}, {"seed": 0}, processes=count.record())
    environment = json.loads((tmp_path / "results.json").read_text())["environment"]
    assert environment["world_size"] == 1
    assert environment["processes"] == {"launcher": "accelerate launch", "requested": 2, "actual": 1}
