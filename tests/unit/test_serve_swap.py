"""The served engine's swap-tier pieces that need no host: the --swap-space arithmetic, seam S10's command rewrite,
the schedule-timer summary (H3)."""

from __future__ import annotations

import json

import pytest

from fdsched.serve.seams import engine, hostcode
from fdsched.serve.config import EngineConfig, ServeError, swap_space_gb
from fdsched.serve.launcher import ServedEngine


def _model(tmp_path, **over):
    cfg = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256, "num_hidden_layers": 2}
    cfg.update(over)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


@pytest.mark.parametrize("blocks,block_size", [(1, 16), (64, 16), (777, 64), (100_000, 128)])
def test_swap_space_gives_exactly_the_blocks(tmp_path, blocks, block_size):
    model = _model(tmp_path)
    gb = swap_space_gb(model, block_size, blocks)
    # FastDeploy's CacheConfig: int(swap_space * 1024**3 / bytes_per_block), bytes_per_block for a bfloat16 cache
    bytes_per_block = 2 * 64 * 2 * 2 * block_size * 2
    assert int(gb * 1024 ** 3 / bytes_per_block) == blocks


def test_negative_cpu_blocks_is_one_clear_error():
    with pytest.raises(ServeError, match=r"--num-cpu-blocks -1: allowed: an integer >= 0"):
        ServedEngine(EngineConfig(num_cpu_blocks=-1))


class _FakeSubprocess:
    def __init__(self):
        self.seen = []

    def Popen(self, cmd, *args, **kwargs):  # noqa: N802
        self.seen.append(cmd)
        return "proc"

    PIPE = -1


def test_s10_replaces_only_the_transfer_manager_script():
    fake = _FakeSubprocess()
    launcher = hostcode._TransferManagerLauncher(fake, "/x/cachexfer.py")
    host = "/h/fastdeploy/cache_manager/cache_transfer_manager.py"
    cmd = f"FLAGS_a=1 CUDA_VISIBLE_DEVICES=0 /usr/bin/python {host} --rank 0 --num_cpu_blocks 8 >/l/x.log 2>&1"
    assert launcher.Popen(cmd, shell=True) == "proc"
    assert fake.seen[-1] == cmd.replace(host, "/x/cachexfer.py")
    messager = "/usr/bin/python /h/fastdeploy/cache_manager/cache_messager.py --rank 0 >/l/m.log 2>&1"
    launcher.Popen(messager, shell=True)  # S12: the PD cache messager is the simulated one beside it
    assert fake.seen[-1] == "/usr/bin/python /x/pdxfer.py --rank 0 >/l/m.log 2>&1"
    other = "/usr/bin/python /h/fastdeploy/cache_manager/cache_tasks.py --rank 0"
    launcher.Popen(other, shell=True)
    assert fake.seen[-1] == other  # any other command is the host's, unchanged
    assert launcher.PIPE == -1  # the rest of the module is the real one


def test_schedule_summary_splits_busy_and_idle(monkeypatch):
    monkeypatch.setattr(engine, "SCHEDULE_TIMES", {"busy_cpu_ns": [1000 * i for i in range(1, 101)],
                                                  "busy_wall_ns": [2000 * i for i in range(1, 101)],
                                                  "idle_calls": 4, "idle_cpu_ns": 8000})
    s = engine.schedule_time_summary()
    assert s["calls"] == 100 and s["cpu_us_mean"] == pytest.approx(50.5) and s["cpu_us_p50"] == 51
    assert s["wall_us_p99"] == 200 and s["idle_calls"] == 4 and s["idle_cpu_us_mean"] == 2.0
