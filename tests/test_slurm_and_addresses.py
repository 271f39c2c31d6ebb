"""`lightning run` inside a SLURM allocation, and the address helpers (no namespaces needed)."""

from __future__ import annotations

import pytest

from lightning_ett.launch.cli import _launch_options, build_parser, first_slurm_host
from lightning_ett.launch.launcher import torchrun_argv
from lightning_ett.launch.network import (
    StoreUnreachableError,
    check_store_reachable,
    interface_with,
    is_loopback,
    route_source,
)

SLURM = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
         "SLURM_JOB_NODELIST": "gpu-a[007-009,012],gpu-b3"}


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def _options(argv, monkeypatch, env):
    for key in ("SLURM_JOB_ID", "SLURM_NNODES", "SLURM_NODEID", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST", "SLURM_LOCALID",
                "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "LIGHTNING_ETT_RUN_DIR"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return _launch_options(build_parser().parse_args(["run", *argv]))


def test_inside_slurm_one_line_is_enough(tmp_path, script, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    opts = _options([str(script)], monkeypatch, SLURM)
    assert (opts.num_nodes, opts.node_rank, opts.main_address, opts.main_port) == (4, 2, "gpu-a007", 15000 + 4242)
    assert opts.job_id == "slurm-4242" and opts.run_dir.name == "slurm-4242"
    argv = torchrun_argv(opts)
    assert argv[argv.index("--rdzv-id") + 1] == "slurm-4242"  # the same job id on every node


def test_explicit_flags_win_over_slurm(tmp_path, script, monkeypatch):
    opts = _options(["--num-nodes", "2", "--node-rank", "1", "--main-address", "head", "--job-id", "mine",
                     "--run-dir", str(tmp_path / "r"), str(script)], monkeypatch, SLURM)
    assert (opts.num_nodes, opts.node_rank, opts.main_address, opts.job_id) == (2, 1, "head", "mine")


def test_outside_slurm_nothing_changes(tmp_path, script, monkeypatch):
    opts = _options(["--run-dir", str(tmp_path / "r"), str(script)], monkeypatch, {})
    assert (opts.num_nodes, opts.node_rank, opts.main_address) == (1, 0, "127.0.0.1")


def test_a_step_is_read_before_the_job_and_several_tasks_per_node_are_refused(tmp_path, script, monkeypatch):
    monkeypatch.chdir(tmp_path)
    opts = _options([str(script)], monkeypatch, {**SLURM, "SLURM_STEP_NODELIST": "gpu-a[008-009]", "SLURM_LOCALID": "0",
                                                 "SLURM_STEP_TASKS_PER_NODE": "1(x4)"})
    assert opts.main_address == "gpu-a008"
    with pytest.raises(ValueError, match=r"runs 8\(x4\) tasks per node.*srun --ntasks-per-node=1"):
        _options([str(script)], monkeypatch, {**SLURM, "SLURM_LOCALID": "3", "SLURM_STEP_TASKS_PER_NODE": "8(x4)"})


def test_a_bad_slurm_variable_names_itself_and_the_flag(tmp_path, script, monkeypatch):
    with pytest.raises(ValueError, match=r"\$SLURM_NNODES='four'.*pass the matching `lightning run` flag"):
        _options([str(script)], monkeypatch, {**SLURM, "SLURM_NNODES": "four"})
    with pytest.raises(ValueError, match=r"SLURM_JOB_NODELIST='gpu\[1-'.*pass --main-address"):
        _options([str(script)], monkeypatch, {**SLURM, "SLURM_JOB_NODELIST": "gpu[1-"})


@pytest.mark.parametrize("nodelist, first", [
    ("node07", "node07"), ("node[07-09,12],gpu5", "node07"), ("gpu-st-[1-2]-x,a1", "gpu-st-1-x"),
    ("rack[1-2]-n[3,4]", "rack1-n3"), ("n[001-004]", "n001"), ("a,b", "a"), ("n[5]", "n5"),
])
def test_the_first_slurm_host_is_what_scontrol_show_hostnames_prints_first(nodelist, first):
    assert first_slurm_host(nodelist) == first


def test_address_helpers():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("10.1.2.3")
    assert is_loopback("no-such-host.invalid")  # unresolvable: as unreachable for the peers as loopback
    # A name that does not resolve (a name server's hiccup at a restart) is retried, then a retryable failure.
    with pytest.raises(StoreUnreachableError, match="cannot resolve") as err:
        check_store_reachable({"MASTER_ADDR": "node07.invalid", "MASTER_PORT": "1", "GROUP_RANK": "1",
                               "GROUP_WORLD_SIZE": "2"}, timeout_s=1)
    assert err.value.retryable
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert interface_with("127.0.0.1") == "lo"
    assert interface_with("203.0.113.77") is None  # not on this host
    # Single node, or the node that hosts rank 0: nothing to check.
    check_store_reachable({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2"})
    check_store_reachable({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1"})
