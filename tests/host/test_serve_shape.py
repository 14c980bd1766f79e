"""``fdsched serve``'s engine-shape check runs the host's own config checks (no engine is started)."""

from __future__ import annotations

from fdsched.serve.config import EngineConfig
from fdsched.serve.preflight import host_shape_problems


def test_a_context_longer_than_the_pool_is_refused_in_the_flags_words():
    problems = host_shape_problems(EngineConfig(max_model_len=100000, num_gpu_blocks=200, block_size=64))
    assert len(problems) == 1
    assert "--max-model-len" in problems[0] and "--num-gpu-blocks" in problems[0]
    assert "site-packages" not in problems[0] and "\n" not in problems[0]


def test_the_default_shape_passes_and_a_pool_too_small_does_not():
    assert host_shape_problems(EngineConfig()) == []
    # 4096 tokens of 64 = 64 blocks, plus the host's encoder/decoder reserve: 200 is plenty, 60 is not
    assert host_shape_problems(EngineConfig(num_gpu_blocks=60)) != []
