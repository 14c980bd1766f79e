"""``fdsched serve`` before anything is spawned: every data-parallel rank has an arm, the engine shape passes the
host's own config checks (one line, in the serve flags' words), and the banner says which profile each rank runs."""

from __future__ import annotations

import os

import pytest

from fdsched.serve.config import EngineConfig
from fdsched.serve.preflight import host_shape_problems, profiles_line, rank_arm_problems, rank_profiles


def _serve_args(*argv):
    from fdsched.tools.cli import build_parser

    return build_parser().parse_args(["serve", *argv])


def test_a_rank_without_an_arm_is_refused_before_start_up():
    from fdsched.serve.cli import check_serve_args

    problems, _trace, _configs = check_serve_args(_serve_args("--dp", "3", "--arms", "0=baseline,1=recommended"))
    assert problems == ["--arms '0=baseline,1=recommended' with --dp 3: rank 2 has no arm; allowed: one "
                        "RANK=PROFILE per rank 0-2 (add 2=PROFILE), --profile P for the ranks without one, or --dp 2 "
                        "if fewer ranks were meant"]
    assert rank_arm_problems("0=baseline,2=adaptive", 3)[0].startswith("--arms '0=baseline,2=adaptive' with --dp 3: "
                                                                       "rank 1 has no arm")
    assert rank_arm_problems("0=baseline,1=adaptive", 2) == []
    assert rank_arm_problems("baseline,adaptive", 1) == []  # arms in turn: not per rank
    assert rank_arm_problems("0=baseline", 2, profile="adaptive") == []  # rank 1 runs --profile, said in the banner
    assert profiles_line("adaptive", "0=baseline", 2) == "profiles: rank 0 baseline, rank 1 adaptive"


def test_the_banner_names_each_ranks_profile():
    assert profiles_line(None, "0=baseline,1=recommended", 2) == "profiles: rank 0 baseline, rank 1 recommended"
    assert profiles_line("adaptive", None, 2) == "profiles: rank 0 adaptive, rank 1 adaptive"
    assert profiles_line(None, None, 1) == "profiles: rank 0 default"
    assert rank_profiles(None, "1=baseline", 2) == ["default", "baseline"]


HOST_MESSAGE = ("prefill_kvcache_block_num: 200 should be larger than or equal to 1564, please reduce the "
                "max_model_len or increase num_gpu_blocks_override")


def test_the_hosts_refusal_is_one_line_in_the_flags_words_and_the_environment_is_kept(monkeypatch):
    import fdsched.replay.engine as engine

    seen = {}

    def refuse(shape, replay_check=True):
        seen["shape"] = shape
        os.environ["ENABLE_V1_KVCACHE_SCHEDULER"] = "0"  # what the host's config classes do on a CPU machine
        raise AssertionError(HOST_MESSAGE + "\nsecond line")

    monkeypatch.setattr(engine, "host_config", refuse)
    monkeypatch.setenv("ENABLE_V1_KVCACHE_SCHEDULER", "1")
    problems = host_shape_problems(EngineConfig(max_model_len=100000))
    assert problems == ["engine shape refused by FastDeploy's own config check: prefill_kvcache_block_num: 200 should "
                        "be larger than or equal to 1564, please reduce the --max-model-len or increase "
                        "--num-gpu-blocks; allowed: a shape it accepts (change the flags it names)"]
    assert seen["shape"].max_model_len == 100000 and seen["shape"].num_gpu_blocks == 200
    assert os.environ["ENABLE_V1_KVCACHE_SCHEDULER"] == "1"
    monkeypatch.setattr(engine, "host_config", lambda shape, replay_check=True: object())
    assert host_shape_problems(EngineConfig()) == []


def test_serve_stops_at_the_shape_check_before_spawning(monkeypatch, capsys, tmp_path):
    import fdsched.serve.cli as cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli._Signals, "install", lambda self: None)  # this test process keeps its own handlers
    monkeypatch.setattr(cli, "_check_host_quietly", lambda: None)
    monkeypatch.setattr(cli, "_check_shapes_quietly", lambda configs: ["engine shape refused by FastDeploy: x"])

    def no_spawn(*a, **k):
        raise AssertionError("spawned")

    monkeypatch.setattr(cli, "ServedEngine", no_spawn)
    assert cli.cmd_serve(_serve_args("--trace", "pressure")) == 1
    assert capsys.readouterr().err.strip() == "fdsched serve: engine shape refused by FastDeploy: x"
    assert not (tmp_path / "serve-out").exists()  # nothing written either


@pytest.mark.parametrize("flag", ["--max-model-len", "--num-gpu-blocks"])
def test_every_host_name_of_the_shape_maps_to_a_serve_flag(flag):
    from fdsched.serve.preflight import HOST_NAMES

    assert flag in dict(HOST_NAMES).values()
    assert flag[2:].replace("-", "_") in vars(_serve_args())  # a flag fdsched serve has
