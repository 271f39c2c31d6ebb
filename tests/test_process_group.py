"""The process group ETTStrategy creates is released before Python finalizes."""

from __future__ import annotations

import textwrap

from conftest import run_script


def test_the_group_is_destroyed_at_exit_for_gloo_too(tmp_path):
    # Lightning destroys only a plain "nccl" group at exit; a gloo worker thread still freeing a
    # collective while Python finalizes aborts the process (pytorch/pytorch#38228).
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import atexit, datetime, torch, torch.distributed as dist
        from lightning.fabric.plugins.environments import LightningEnvironment
        from lightning_ett.strategies.process_group import init_process_group
        # Registered first, so it runs after the strategy's own exit handler.
        atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
        env = LightningEnvironment()  # a free port, as Lightning picks one
        init_process_group(env, "gloo", 0, 1, torch.device("cpu"), datetime.timedelta(seconds=60))
        init_process_group(env, "gloo", 0, 1, torch.device("cpu"), None)  # already formed: a no-op
        out = torch.empty(4)
        dist.all_to_all_single(out, torch.arange(4.0))  # a collective just before exit
        assert out.tolist() == [0.0, 1.0, 2.0, 3.0]
        print("group:", dist.get_backend(), flush=True)
    """))
    proc = run_script(str(script), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "group: gloo" in proc.stdout
    assert "initialized at exit: False" in proc.stdout, proc.stdout
