# Source first in every remote call (from the repo root there): env, wheels, assets, `assemble`.
export PYTHONUNBUFFERED=1 DFLASH_ASSETS=/tmp/a DFLASH_NO_PROGRESS=1 WANDB_MODE=disabled
export TRANSFORMERS_VERBOSITY=warning
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p /tmp/a/parts /tmp/a/humaneval /tmp/a/qwen05 /tmp/a/smollm2 /tmp/a/sharegpt /tmp/a/state /tmp/res
if [ ! -d /tmp/site ] && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || echo "WHEEL INSTALL FAILED"
fi
export PYTHONPATH=/tmp/site
[ -f .gpu/HumanEval.jsonl.gz ] && cp .gpu/HumanEval.jsonl.gz /tmp/a/humaneval/
assemble() {  # cat the uploaded chunks (/tmp/a/parts) into the GGUFs / ShareGPT, sha256 checked
  local q=/tmp/a/qwen05/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf
  local s=/tmp/a/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  if ls /tmp/a/parts/q05_* >/dev/null 2>&1 && [ ! -f $q ]; then
    cat /tmp/a/parts/q05_* > $q
    echo "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32  $q" | sha256sum -c
  fi
  if ls /tmp/a/parts/sm_* >/dev/null 2>&1 && [ ! -f $s ]; then
    cat /tmp/a/parts/sm_* > $s
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $s" | sha256sum -c
  fi
  if ls /tmp/a/parts/sg_* >/dev/null 2>&1 && [ ! -f /tmp/a/sharegpt/sharegpt.jsonl ]; then
    local sums=$PWD/.gpu/sharegpt.sha256
    cat /tmp/a/parts/sg_* > /tmp/a/sharegpt/sharegpt.jsonl
    (cd /tmp/a/sharegpt && sha256sum -c "$sums") || rm -f /tmp/a/sharegpt/sharegpt.jsonl
  fi
}
convert_target() {  # the GGUF -> transformers conversion of $EXP's target (cached), timed to the status
  local t=$(date +%s)
  python3 -c "
from dflash.run.cli import run_config
from dflash.target.load import resolve_local_path
print(resolve_local_path(run_config(['+exp=$EXP']).target))" > /tmp/res/convert.out 2>&1
  echo "convert rc=$? $(( $(date +%s) - t )) s" >> /tmp/res/status
}
