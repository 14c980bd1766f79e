#!/usr/bin/env bash
# Start a FastDeploy 2.6 OpenAI-compatible server with the plugin (a GPU machine with fastdeploy-gpu installed).
# FastDeploy loads no plugin unless FD_PLUGINS lists it.
#
# Run it from a checkout of this project: the package is not on a package index yet, so it is installed from
# the checkout (next to fastdeploy-gpu / paddlepaddle-gpu). On a machine without them the script stops at
# `fdsched doctor` (exit 2: no FastDeploy host); with a CPU host from `fdsched host setup` it gets past doctor and
# stops at the server (exit 1: MODEL unset; serving a model needs the GPU) -- everything before that works anywhere.
set -euo pipefail

cd "$(dirname "$0")/.."                         # the checkout's root (setup.cfg is there)
python -m pip install .                         # or a wheel built with: python -m build --wheel

export FD_PLUGINS=fdsched                       # FastDeploy's loader calls the fdsched entry point
export FDSCHED_PROFILE=recommended              # every change on (PD prefill cache in safe mode)
# export FDSCHED_RATIO_RESERVE=off              # any single change can be overridden
# export FD_INIT_NEW_TOKEN_RATIO=0.5            # the host's own tunables keep their names

fdsched profiles "$FDSCHED_PROFILE"             # the profile, checked as the engine will load it
fdsched doctor                                  # what the host has, what will be applied; exit 1: something to fix

python -m fastdeploy.entrypoints.openai.api_server \
  --model "${MODEL:?set MODEL to a model directory}" \
  --port 8188 --max-model-len 32768 --max-num-seqs 128 \
  --enable-prefix-caching
# The engine log shows one line: "[fdsched] fdsched installed (profile recommended) on FastDeploy ...: <change>=<state>; ..."
