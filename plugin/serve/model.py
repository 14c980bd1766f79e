"""A tiny model directory for the served engine: config.json, generation_config.json and a small WordLevel
tokenizer built with the ``tokenizers`` package; no weights (the simulated worker runs no model).

Words are ``w0`` .. ``w{N}`` plus a few specials; a prompt of ``n`` space-separated words is ``n`` tokens,
so a trace's prompt lengths map onto prompts exactly (:func:`prompt_of_length`). After them come the length
mark's marker words (``fdsched_len1`` ..; :mod:`fdsched.serve.lengthmark`), which no trace prompt produces.
"""

from __future__ import annotations

import json
import os
import tempfile

SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "\n"]
NUM_WORDS = 900
MARKER_WORDS = ("fdsched_len1", "fdsched_len2", "fdsched_len3")  # the length mark's, after w0 .. w899
EOS_TOKEN_ID = 2
VERSION = "2"


def cache_dir() -> str:
    home = os.environ.get("FDSCHED_HOME")
    base = os.path.join(home, "cache") if home else os.path.join(tempfile.gettempdir(), "fdsched-cache")
    return os.path.join(base, f"tinymodel-v{VERSION}")


def make_model(directory: str = None) -> str:
    """Write the model directory (once; reused when complete) and return its path.

    Written into a private directory beside it and renamed into place, so that two launchers starting at once
    never read each other's half-written files: the first rename wins, the other discards its copy."""
    import shutil

    directory = directory or cache_dir()
    done = os.path.join(directory, ".complete")
    if os.path.exists(done):
        return directory
    parent = os.path.dirname(os.path.abspath(directory))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=".tinymodel-")
    try:
        _write_model(tmp)
        try:
            os.rename(tmp, directory)
        except OSError:
            if not os.path.exists(done):  # an incomplete directory from an interrupted run: replace it
                shutil.rmtree(directory, ignore_errors=True)
                try:
                    os.rename(tmp, directory)
                except OSError:
                    pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ours, when another launcher's copy won
    if not os.path.exists(done):
        raise OSError(f"the served engine's model directory {directory} could not be written")
    return directory


def _write_model(directory: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = SPECIALS + [f"w{i}" for i in range(NUM_WORDS)] + list(MARKER_WORDS)
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(directory, "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
    _write(directory, "tokenizer_config.json", dict(special, tokenizer_class="PreTrainedTokenizerFast",
                                                    model_max_length=131072,
                                                    chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}"))
    _write(directory, "special_tokens_map.json", special)
    _write(directory, "config.json", {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": len(words),
        "max_position_embeddings": 131072, "bos_token_id": 1, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": 3,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": True})
    _write(directory, "generation_config.json", {"bos_token_id": 1, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": 3})
    open(os.path.join(directory, ".complete"), "w").close()


def prompt_of_length(n: int, seed: int = 0, prefix: str = "") -> str:
    """A prompt of exactly ``n`` tokens (``prefix`` words count too)."""
    import random

    rng = random.Random(seed)
    have = prefix.split()
    return " ".join(have + [f"w{rng.randrange(NUM_WORDS)}" for _ in range(max(0, n - len(have)))])


def _write(directory, name, obj):
    with open(os.path.join(directory, name), "w") as fh:
        json.dump(obj, fh, indent=1)
