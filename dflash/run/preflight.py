"""Checks that need no model, run before anything loads: a bad resume path, a missing file, a
target that needs CUDA on a machine without it, or a target whose weights alone do not fit in
the memory of the device they would load on. Each failure is one ValueError/FileNotFoundError
naming the key and what to do (the entry points print `error: ...`, exit 2), raised in seconds
instead of after minutes of loading (a random 27B target on a CPU box was OOM-killed after
4.5 minutes)."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import struct

import torch

from ..config import FILE_SOURCES, RunConfig, TargetConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GB = 1e9


def check_run(cfg: RunConfig, hold_reads: bool = False) -> None:
    """Everything train.py can check before the target loads (the resume checkpoint is found
    and checked by `rundir.plan_run`, which runs next). hold_reads: this process builds the
    data, so the prompt files it reads are held for that (read once, not twice)."""
    check_target_resources(cfg.target)
    check_files(cfg, hold_reads)
    check_dist(cfg)


def check_dist(cfg: RunConfig) -> None:
    if cfg.train.time_budget_min is not None and cfg.topology.mode == "split":
        raise ValueError(
            "train.time_budget_min is not supported with topology=split yet (the target workers "
            "produce batches for train.steps); set train.steps, or run topology=colocated"
        )
    if cfg.train.dist == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            raise ValueError(
                "train.dist=deepspeed but DeepSpeed is not installed: pip install 'dflash[deepspeed]'"
            ) from None


def check_files(cfg: RunConfig, hold_reads: bool = False) -> None:
    if cfg.target.path is not None and not os.path.exists(os.path.expanduser(cfg.target.path)):
        hint = ""
        if cfg.target.gguf_file:  # the small real targets: a GGUF the fetch script brings
            hint = (
                f"; target {cfg.target.name!r} is read from {cfg.target.gguf_file}: fetch it with "
                "`bash ../shared/scripts/fetch_models.sh` (README) into $DFLASH_ASSETS "
                "(default ~/.cache/dflash)"
            )
        raise FileNotFoundError(
            f"target.path={cfg.target.path!r} does not exist; set target.path to a local "
            f"directory with the target's weights (nothing is downloaded at run time){hint}"
        )
    if cfg.drafter.init_from and not os.path.isdir(cfg.drafter.init_from):
        raise FileNotFoundError(
            f"drafter.init_from={cfg.drafter.init_from!r} is not a directory (a drafter "
            "checkpoint: config.json + model.safetensors)"
        )
    groups = [("eval.paths", cfg.eval.source, cfg.eval.paths)]
    groups += [(f"eval.sets[{s.name}].paths", s.source, s.paths) for s in cfg.eval.sets]
    groups += [(f"data.mix[{m.name}].paths", m.source, m.paths) for m in cfg.data.mix]
    if cfg.data.source in FILE_SOURCES:
        groups.insert(0, ("data.paths", cfg.data.source, cfg.data.paths))
    for key, source, paths in groups:
        for p in paths:
            if source == "hf" and _hub_name(p):
                continue  # a hub dataset: read (or refused) when the data is built
            if not glob.glob(os.path.expanduser(p)):
                raise FileNotFoundError(
                    f"{key}: {p!r} does not exist (no file matches it)" + _asset_hint(p)
                )
    from ..eval.heldout import check_eval_sets

    check_eval_sets(cfg)
    check_prompt_files(cfg, hold_reads)


def _asset_hint(path: str) -> str:
    """How to get a missing file that lies where fetch_models.sh puts its data sets."""
    from ..data.corpora import assets_dir

    root = os.path.abspath(assets_dir())
    full = os.path.abspath(os.path.expanduser(path))
    if not full.startswith(root + os.sep):
        return ""
    name = os.path.relpath(full, root).split(os.sep)[0]
    return (
        f"; fetch it with `bash ../shared/scripts/fetch_models.sh {name}` (or set DFLASH_ASSETS "
        "to where it is)"
    )


def _hub_name(p: str) -> bool:
    """owner/name of a hub dataset, not a local path."""
    return not os.path.isabs(p) and not p.startswith((".", "~")) and not os.path.exists(p)


def check_prompt_files(cfg: RunConfig, hold_reads: bool = False) -> None:
    """Read and check every prompt row of the local prompt files now (bad JSON, a binary file,
    wrong fields, a parquet source that is not parquet, no rows at all): minutes before the
    target would have loaded."""
    from ..data.files import read_conversations
    from ..eval.heldout import training_sources

    local = ("jsonl", "parquet")
    for dcfg in training_sources(cfg, local):  # the rows training reads of each source, held
        read_conversations(dcfg, log=lambda *_: None, keep=hold_reads)  # for the run's read
    source = cfg.eval.source or cfg.data.source
    if cfg.eval.enabled and cfg.eval.paths and source in local:
        ecfg = dataclasses.replace(
            cfg.data, source=source, paths=list(cfg.eval.paths), num_samples=cfg.eval.num_prompts
        )
        read_conversations(ecfg, log=lambda *_: None)


def check_target_resources(tcfg: TargetConfig, device: str | None = None) -> None:
    """Refuse a target this machine cannot load: CUDA asked for but absent, fla kernels without
    CUDA, or weights larger than the free memory of the device (target.check_memory=false
    skips the memory part)."""
    dev = _resolve_device(device or tcfg.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"target {tcfg.name!r} is set to load on {dev} but this machine has no CUDA "
            "device; run it on a GPU machine or set target.device=cpu"
        )
    if tcfg.linear_attn_backend == "fla" and dev.type != "cuda":
        raise ValueError(
            "target.linear_attn_backend=fla needs a CUDA device (Triton GPU kernels); use "
            "target.linear_attn_backend=torch on CPU"
        )
    if not tcfg.check_memory:
        return
    need = target_weight_bytes(tcfg, _dtype_name(tcfg.dtype, dev))
    have = available_bytes(dev)
    if need is not None and have is not None and need > have:
        raise ValueError(
            f"target {tcfg.name!r} needs ~{need / GB:.1f} GB for its weights alone "
            f"({_dtype_name(tcfg.dtype, dev)} on {dev}) but {dev} has {have / GB:.1f} GB free; "
            + (
                "run it on a GPU machine (this one has no CUDA device) or pick a smaller target "
                "(e.g. target=tiny_qwen3_5)"
                if dev.type == "cpu"
                else "use a GPU with more free memory, or a smaller target"
            )
            + " (target.check_memory=false skips this check)"
        )


def target_weight_bytes(tcfg: TargetConfig, dtype: str) -> int | None:
    """Bytes of the target's parameters at `dtype`: exact from safetensors headers for a local
    directory, estimated from the shape for a random-weight config; None when unknown (GGUF)."""
    per = _DTYPE_BYTES[dtype]
    if tcfg.config is not None:
        return per * estimate_params(tcfg.config)
    if tcfg.path is None:
        return None
    files = glob.glob(os.path.join(os.path.expanduser(tcfg.path), "*.safetensors"))
    if not files:
        return None
    return per * sum(_safetensors_numel(f) for f in files)


def estimate_params(c: dict) -> int:
    """Parameters of a decoder-only config: embeddings, lm_head unless tied, and per layer the
    attention projections, a gated MLP and two norms. Linear-attention layers are counted as
    full-attention ones (their projections are of the same order): an estimate for refusing
    targets that clearly do not fit, not an exact count."""
    get = lambda k, d=None: c.get(k, d) if c.get(k) is not None else d
    V, H, L = int(get("vocab_size", 32000)), int(get("hidden_size")), int(get("num_hidden_layers"))
    heads = int(get("num_attention_heads", 1))
    kv = int(get("num_key_value_heads", heads))
    hd = int(get("head_dim", H // heads))
    inter = int(get("intermediate_size", 4 * H))
    attn = H * heads * hd * 2 + H * kv * hd * 2
    mlp = 3 * H * inter
    embed = V * H * (1 if get("tie_word_embeddings", False) else 2)
    return embed + L * (attn + mlp + 2 * H) + H


def available_bytes(dev: torch.device) -> int | None:
    """Free memory of the device: CUDA's mem_get_info; on CPU the smaller of the system's
    available memory and what the cgroup (container) limit leaves."""
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu":
        return None
    cands = []
    try:
        import psutil

        cands.append(int(psutil.virtual_memory().available))
    except ImportError:
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            cands.append(int(info["MemAvailable"].split()[0]) * 1024)
        except (OSError, KeyError, ValueError):
            try:
                cands.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
            except (ValueError, OSError):
                pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                cands.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return min(cands) if cands else None


def _resolve_device(name: str) -> torch.device:
    """As the run will place the target: under torchrun on cuda:$LOCAL_RANK (asking cuda:0 from
    every rank would also open a CUDA context per rank on GPU 0)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def _dtype_name(dtype: str, dev: torch.device) -> str:
    if dtype == "auto":
        return "bfloat16" if dev.type == "cuda" else "float32"
    return dtype


def _safetensors_numel(path: str) -> int:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        numel = 1
        for d in meta["shape"]:
            numel *= d
        total += numel
    return total
