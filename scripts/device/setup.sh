#!/usr/bin/env bash
# Prepare, on the dev machine (repo root), what the remote GPU machine needs that it lacks:
# wheels (.whl/), the real GGUFs and the ShareGPT file in <=56 MB chunks (.gl/, one chunk per
# call: a call carries at most 64 MiB), HumanEval and the ShareGPT file's sha256 (.gpu/). All
# three folders are git-ignored. See README.md here.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
A=${DFLASH_ASSETS:-$HOME/.cache/dflash}
SHARED=${DFLASH_SHARED:-$(cd .. && pwd)/shared}
bash "$SHARED/scripts/fetch_models.sh" smollm2 qwen05 humaneval sharegpt >/dev/null
mkdir -p .whl .gl .gpu
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any"
python3 -m pip download -q --no-deps $plat -d .whl hydra-core==1.3.8 omegaconf==2.3.0 gguf==0.19.0
ls .whl/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1 || {  # sdist only: build the wheel here
  python3 -m pip download -q --no-deps --no-binary=:all: -d /tmp/antlr antlr4-python3-runtime==4.9.3
  python3 -m pip wheel -q --no-deps -w .whl /tmp/antlr/antlr4-python3-runtime-4.9.3.tar.gz
}
[ -f .gl/q05_00 ] || (cd .gl && split -b 56000000 -d "$A/qwen05/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" q05_)
[ -f .gl/sm_00 ] || (cd .gl && split -b 56000000 -d "$A/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" sm_)
[ -f .gl/sg_00 ] || (cd .gl && split -b 56000000 -d "$A/sharegpt/sharegpt.jsonl" sg_)
cp "$A/humaneval/HumanEval.jsonl.gz" .gpu/
(cd "$A/sharegpt" && sha256sum sharegpt.jsonl) > .gpu/sharegpt.sha256  # assemble checks it there
ls .whl .gl .gpu
