#!/usr/bin/env python3
"""Re-derive the replay's calibrated step-cost preset from Vidur's published operator profiles.

Usage (from the repository root)::

    python tools/fit_costmodel.py                       # the committed slices -> preset YAML on stdout
    python tools/fit_costmodel.py --mlp PATH/mlp.csv --attention PATH/attention.csv --out preset.yaml
    python tools/fit_costmodel.py --check plugin/replay/costmodels/llama2-7b-a100.yaml

``--mlp`` / ``--attention`` take either Vidur's full files
(github.com/microsoft/vidur, data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/{mlp,attention}.csv;
the attention file is stored with Git LFS, about 10.7 MB) or the slices committed next to this script
(tools/costmodel-data/). Rows are filtered to Llama-2-7B's shape on one GPU (tensor parallel 1,
32 query and KV heads, hidden size 4096, block size 16 where the columns exist). ``--check`` exits 1
when the file's coefficients differ from the fit (relative 1e-6).

Every time in Vidur's files is the median of its repeated CUDA timings of one operator in ONE layer,
in milliseconds; a step runs 32 layers, so each fitted per-layer number is multiplied by 32. The
fits are ordinary least squares solved here without numpy (normal equations on scaled columns), so
the script runs anywhere the plugin does.

The step model (fdsched/replay/costmodel.py)::

    step_ms = fixed + max(floor, per_prefill_token * P + per_decode_request * D)
            + per_prefill_context_token * prefill_context_tokens + per_decode_context_token * decode_context_tokens

1. Token-linear operators (mlp.csv: attn_pre_proj, attn_post_proj, attn_rope, input_layernorm,
   post_attention_layernorm, mlp_up_proj, mlp_act, mlp_down_proj, add; the ones Vidur's own
   predictor adds per layer): their sum y(n) over n tokens is flat while the weights' read bounds it
   and linear once compute does. ``floor_total`` = mean y over n <= 64; (a, b) = least squares of y
   on n over n >= 512. Then fixed = a, token_floor = floor_total - a, and b is every token's share.
2. Decode attention (attention.csv rows with is_prefill False: batch B requests, each holding kv
   tokens): attn_decode = beta * B + gamma * B * kv, least squares without intercept.
3. Prefill attention (rows with is_prefill True: one chunk of c tokens over a prefix of kv tokens):
   attn_prefill = eps * c + delta * pairs, pairs = c * kv + c * (c + 1) / 2 (the tokens the chunk's
   tokens attend to, summed), least squares without intercept.
4. per_prefill_token = b + 32 eps; per_decode_request = b + 32 beta; per_prefill_context_token =
   32 delta; per_decode_context_token = 32 gamma.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "costmodel-data"
DEFAULT_MLP = DATA / "vidur-a100-llama2-7b-mlp-tp1.csv"
DEFAULT_ATTENTION = DATA / "vidur-a100-llama2-7b-attention-slice.csv"
LAYERS = 32
TOKEN_OPS = (
    "attn_pre_proj", "attn_post_proj", "attn_rope", "input_layernorm", "post_attention_layernorm",
    "mlp_up_proj", "mlp_act", "mlp_down_proj", "add",
)
FLOOR_MAX_TOKENS = 64
LINEAR_MIN_TOKENS = 512
SHAPE = {"num_tensor_parallel_workers": "1", "n_head": "32", "n_q_head": "32", "n_kv_head": "32", "n_embd": "4096",
         "block_size": "16"}

VIDUR = {
    "repository": "github.com/microsoft/vidur",
    "commit": "7d47513363ec447a741ac5e47241580b47724fbf",
    "mlp": "data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv",
    "attention": "data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/attention.csv",
    "licence": "MIT (Copyright (c) Microsoft Corporation), github.com/microsoft/vidur/blob/main/LICENSE",
}


def _rows(path: Path) -> list:
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    return [r for r in rows if all(r.get(k) in (None, "", v) for k, v in SHAPE.items())]


def lstsq(columns: list, y: list) -> tuple:
    """Least squares ``y ~ sum(c_j * columns[j])``: (coefficients, residuals). Columns are scaled to
    max |value| 1 before the normal equations are solved by Gauss-Jordan elimination with pivoting."""
    k = len(columns)
    scale = [max(abs(v) for v in col) or 1.0 for col in columns]
    cols = [[v / s for v in col] for col, s in zip(columns, scale)]
    a = [[sum(ci * cj for ci, cj in zip(cols[i], cols[j])) for j in range(k)] for i in range(k)]
    rhs = [sum(ci * yi for ci, yi in zip(cols[i], y)) for i in range(k)]
    for p in range(k):
        pivot = max(range(p, k), key=lambda r: abs(a[r][p]))
        a[p], a[pivot] = a[pivot], a[p]
        rhs[p], rhs[pivot] = rhs[pivot], rhs[p]
        for r in range(k):
            if r != p and a[p][p]:
                f = a[r][p] / a[p][p]
                a[r] = [x - f * z for x, z in zip(a[r], a[p])]
                rhs[r] -= f * rhs[p]
    coef = [rhs[i] / a[i][i] / scale[i] for i in range(k)]
    fitted = [sum(c * col[i] for c, col in zip(coef, columns)) for i in range(len(y))]
    return coef, [yi - fi for yi, fi in zip(y, fitted)]


def _stats(residuals: list, y: list) -> dict:
    rms = math.sqrt(sum(r * r for r in residuals) / len(residuals))
    worst = max(range(len(residuals)), key=lambda i: abs(residuals[i]))
    rel = [abs(r) / v for r, v in zip(residuals, y) if v]
    return {"rows": len(y), "rms_ms": rms, "max_abs_ms": abs(residuals[worst]),
            "median_abs_rel": sorted(rel)[len(rel) // 2] if rel else 0.0}


def fit(mlp_path: Path, attention_path: Path) -> dict:
    # 1. token-linear operators
    mlp = _rows(mlp_path)
    if not mlp:
        raise SystemExit(f"{mlp_path}: no Llama-2-7B tensor-parallel-1 rows")
    points = sorted((int(r["num_tokens"]), LAYERS * sum(float(r[f"time_stats.{op}.median"]) for op in TOKEN_OPS))
                    for r in mlp)
    small = [y for n, y in points if n <= FLOOR_MAX_TOKENS]
    floor_total = sum(small) / len(small)
    big = [(n, y) for n, y in points if n >= LINEAR_MIN_TOKENS]
    (a, b), _ = lstsq([[1.0] * len(big), [float(n) for n, _ in big]], [y for _, y in big])
    roof = [max(floor_total, a + b * n) for n, _ in points]
    token_stats = _stats([y - f for (_, y), f in zip(points, roof)], [y for _, y in points])
    token_stats["tokens"] = f"{points[0][0]}..{points[-1][0]}"

    # 2. and 3. attention
    att = _rows(attention_path)
    dec = [r for r in att if r["is_prefill"] == "False" and r["time_stats.attn_decode.median"]]
    pre = [r for r in att if r["is_prefill"] == "True" and r["time_stats.attn_prefill.median"]]
    if not dec or not pre:
        raise SystemExit(f"{attention_path}: needs decode and prefill rows of Llama-2-7B, tensor parallel 1")
    bsz = [float(r["batch_size"]) for r in dec]
    held = [float(r["batch_size"]) * float(r["kv_cache_size"]) for r in dec]
    yd = [float(r["time_stats.attn_decode.median"]) for r in dec]
    (beta, gamma), rd = lstsq([bsz, held], yd)
    chunk = [float(r["prefill_chunk_size"]) for r in pre]
    kv = [float(r["kv_cache_size"]) for r in pre]
    pairs = [c * k + c * (c + 1) / 2 for c, k in zip(chunk, kv)]
    yp = [float(r["time_stats.attn_prefill.median"]) for r in pre]
    (eps, delta), rp = lstsq([chunk, pairs], yp)
    dec_stats = {k: (v * LAYERS if k.endswith("_ms") else v) for k, v in _stats(rd, yd).items()}
    pre_stats = {k: (v * LAYERS if k.endswith("_ms") else v) for k, v in _stats(rp, yp).items()}

    coefficients = {
        "step_fixed_ms": a,
        "per_prefill_token_ms": b + LAYERS * eps,
        "per_decode_request_ms": b + LAYERS * beta,
        "token_floor_ms": floor_total - a,
        "per_prefill_context_token_ms": LAYERS * delta,
        "per_decode_context_token_ms": LAYERS * gamma,
    }
    if min(coefficients.values()) < 0:
        raise SystemExit(f"a fitted coefficient is negative: {coefficients}")
    return {
        "coefficients": coefficients,
        "parts": {"floor_total": floor_total, "a": a, "b": b, "beta": beta, "gamma": gamma, "eps": eps, "delta": delta},
        "fit": {"token_operators": token_stats, "decode_attention": dec_stats, "prefill_attention": pre_stats},
        "rows": {"mlp": len(mlp), "decode": len(dec), "prefill": len(pre)},
    }


def _g(x: float) -> str:
    return f"{x:.6g}"


def preset_yaml(result: dict, mlp_path: Path, attention_path: Path) -> str:
    c, p, f, n = result["coefficients"], result["parts"], result["fit"], result["rows"]
    knee = (p["floor_total"] - p["a"]) / p["b"]

    def stats(s: dict) -> str:
        return (f"{{rows: {s['rows']}, rms_ms: {_g(s['rms_ms'])}, max_abs_ms: {_g(s['max_abs_ms'])}, "
                f"median_abs_rel: {_g(s['median_abs_rel'])}}}")

    return f"""# Step-cost preset for the fdsched replay (docs/costmodel.md). Generated by tools/fit_costmodel.py from
# {mlp_path.name} and {attention_path.name}; re-derive with: python tools/fit_costmodel.py --check <this file>
name: llama2-7b-a100
description: >-
  Llama-2-7B (fp16) on one NVIDIA A100, tensor parallel 1, GPU time of the model's layers only (Vidur's
  operator profiles, FlashAttention backend, KV block size 16). CPU overheads (scheduling, sampling,
  detokenizing) and the LM head are not in the profiles and not in the numbers.
units: >-
  ms per engine step; token counts in tokens; per_prefill_context_token_ms per (prefill token x token it
  attends to); per_decode_context_token_ms per token held by a decoding request.
source:
  data: Vidur's published operator profiles (Agrawal et al., Vidur, MLSys 2024)
  repository: {VIDUR['repository']}
  commit: {VIDUR['commit']}
  mlp: {VIDUR['mlp']} (tensor-parallel-1 rows, read from that commit)
  attention: >-
    {VIDUR['attention']} (Git LFS, 10,680,357 bytes; upstream's blob was not retrievable here, so its
    rows were read from an identical-size copy at github.com/sw5sh/cs378-assignment3, commit
    7ac2fe9fb6cea9d4630659a10c5cccfc9fbdd776, same path; a sample of {n['decode']} decode and {n['prefill']} prefill rows,
    tools/costmodel-data/)
  licence: {VIDUR['licence']}
derivation:
  layers: 32 (each Vidur time is one layer's median, ms; per-layer fits are multiplied by 32)
  token_operators: >-
    y(n) = 32 x sum of the medians of attn_pre_proj, attn_post_proj, attn_rope, input_layernorm,
    post_attention_layernorm, mlp_up_proj, mlp_act, mlp_down_proj, add over the {n['mlp']} rows n = 1..4096 tokens.
    Flat while reading the weights bounds it: floor = mean y over n <= {FLOOR_MAX_TOKENS} = {_g(p['floor_total'])} ms.
    Linear once compute bounds it: least squares y = a + b n over n >= {LINEAR_MIN_TOKENS}: a = {_g(p['a'])} ms,
    b = {_g(p['b'])} ms/token. The step pays max(floor, a + b n): knee at n = {_g(knee)} tokens.
  step_fixed_ms: a
  token_floor_ms: floor - a
  decode_attention: >-
    attn_decode median = beta B + gamma B kv over {n['decode']} rows (B = 1..128 requests each holding kv = 32..4032
    tokens), least squares without intercept: beta = {_g(p['beta'])} ms/request/layer, gamma = {_g(p['gamma'])}
    ms/held token/layer.
  per_decode_request_ms: b + 32 beta
  per_decode_context_token_ms: 32 gamma
  prefill_attention: >-
    attn_prefill median = eps c + delta (c kv + c (c + 1) / 2) over {n['prefill']} rows (one chunk of c = 64..2048 tokens
    over a prefix of kv = 0..3840 tokens), least squares without intercept: eps = {_g(p['eps'])} ms/token/layer,
    delta = {_g(p['delta'])} ms/attended token/layer.
  per_prefill_token_ms: b + 32 eps
  per_prefill_context_token_ms: 32 delta
fit:
  token_operators: {stats(f['token_operators'])}
  decode_attention: {stats(f['decode_attention'])}
  prefill_attention: {stats(f['prefill_attention'])}
coefficients:
  step_fixed_ms: {_g(c['step_fixed_ms'])}
  per_prefill_token_ms: {_g(c['per_prefill_token_ms'])}
  per_decode_request_ms: {_g(c['per_decode_request_ms'])}
  token_floor_ms: {_g(c['token_floor_ms'])}
  per_prefill_context_token_ms: {_g(c['per_prefill_context_token_ms'])}
  per_decode_context_token_ms: {_g(c['per_decode_context_token_ms'])}
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mlp", type=Path, default=DEFAULT_MLP, help="Vidur's mlp.csv (or the committed slice)")
    ap.add_argument("--attention", type=Path, default=DEFAULT_ATTENTION, help="Vidur's attention.csv (or the slice)")
    ap.add_argument("--out", type=Path, help="write the preset here (default: standard output)")
    ap.add_argument("--check", type=Path, metavar="PRESET", help="compare PRESET's coefficients with the fit")
    args = ap.parse_args(argv)
    result = fit(args.mlp, args.attention)
    if args.check:
        import yaml

        shipped = yaml.safe_load(args.check.read_text(encoding="utf-8"))["coefficients"]
        bad = {k: (shipped.get(k), float(_g(v))) for k, v in result["coefficients"].items()
               if shipped.get(k) is None or not math.isclose(shipped[k], float(_g(v)), rel_tol=1e-6, abs_tol=1e-15)}
        for k, (have, want) in bad.items():
            print(f"{args.check}: {k} = {have}, the fit gives {want}", file=sys.stderr)
        if not bad:
            print(f"{args.check}: every coefficient matches the fit")
        return 1 if bad else 0
    text = preset_yaml(result, args.mlp, args.attention)
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
