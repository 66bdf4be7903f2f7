"""Loading the frozen target: a local Hugging Face directory, a GGUF folder (converted once) or a
config with random weights, on the chosen device, dtype and Gated-DeltaNet backend
(dflash.target.linear_attn), wrapped as a capturing `Target` (dflash.target.capture)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Sequence

import torch

from ..config import TargetConfig
from .capture import Target
from .graphs import CompiledLayers
from .linear_attn import check_bound_backend, prepare_fla_kernels, select_linear_attn_backend
from .shape import default_layer_ids


# ----------------------------------------------------------------------------- backend selection
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def concrete_settings(cfg: TargetConfig) -> dict:
    """The target's settings with `device` and `dtype` "auto" resolved on this machine, as they
    name a cache: a data cache or an eval set of `auto` written on a CPU (float32) is not read
    by the same command on a GPU (bfloat16), whose text differs at near-ties."""
    out = dict(vars(cfg))
    device = resolve_device(cfg.device)
    if cfg.device == "auto":
        out["device"] = device.type
    if cfg.dtype == "auto":
        out["dtype"] = str(resolve_dtype("auto", device)).removeprefix("torch.")
    return out


# ----------------------------------------------------------------------------- loading
CONF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "conf")


def load_conf(group: str, name_or_path: str) -> dict:
    """A conf/<group> yaml (by name, or a path) as a plain dict, without Hydra (tools and GPU
    machines may lack it); `${oc.env:VAR,default}` is resolved."""
    path = name_or_path
    if not os.path.exists(path):
        path = os.path.join(CONF_DIR, group, f"{name_or_path.removesuffix('.yaml')}.yaml")
    if not os.path.exists(path):
        names = sorted(
            f[:-5] for f in os.listdir(os.path.join(CONF_DIR, group)) if f.endswith(".yaml")
        )
        raise FileNotFoundError(
            f"{group} {name_or_path!r}: no such yaml; choose one of {names} or give a path"
        )
    try:
        from omegaconf import OmegaConf

        conf = OmegaConf.load(path)
        missing = [k for k in conf if OmegaConf.is_missing(conf, k)]
        raw = OmegaConf.to_container(conf, resolve=True)
        raw.update({k: "???" for k in missing})  # mandatory: the user must set it
    except ImportError:
        import yaml

        with open(path) as f:
            raw = _resolve_env(yaml.safe_load(f))
    return {k: v for k, v in (raw or {}).items() if k != "defaults"}


def target_config_from_yaml(name_or_path: str, **overrides) -> TargetConfig:
    """A TargetConfig from a conf/target yaml (e.g. `tiny_qwen3_5`) plus overrides."""
    return TargetConfig(**{**load_conf("target", name_or_path), **overrides})


def _resolve_env(x):
    if isinstance(x, dict):
        return {k: _resolve_env(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_resolve_env(v) for v in x]
    if not isinstance(x, str):
        return x
    pat = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^${}]*))?\}")
    while (m := pat.search(x)) is not None:  # innermost first: defaults hold no ${...}
        x = x[: m.start()] + os.environ.get(m.group(1), m.group(2) or "") + x[m.end() :]
    return x


def build_hf_config(config: dict):
    from transformers import AutoConfig

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if model_type is None:
        raise ValueError("target.config needs a model_type (e.g. qwen3_5_text, llama, qwen2)")
    return AutoConfig.for_model(model_type, **cfg)


def load_hf_model(cfg: TargetConfig, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = None
    if cfg.tokenizer is not None and cfg.config is None:
        raise ValueError(
            f"target.tokenizer={cfg.tokenizer!r} is for targets built from target.config; a target "
            "loaded from target.path uses the tokenizer in its directory: set target.tokenizer=null"
        )
    if cfg.config is not None:
        from .tokenizer import make_tokenizer

        hf_cfg = build_hf_config(cfg.config)
        tokenizer = make_tokenizer(cfg.tokenizer, int(hf_cfg.vocab_size))
        if cfg.init_std is not None:
            hf_cfg.initializer_range = cfg.init_std
        torch.manual_seed(cfg.init_seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                hf_cfg, dtype=dtype, attn_implementation=cfg.attn_implementation
            )
        if cfg.lm_head_scale != 1.0:
            if getattr(hf_cfg, "tie_word_embeddings", False):
                raise ValueError(
                    "target.lm_head_scale needs target.config.tie_word_embeddings=false (a tied "
                    "head would rescale the input embeddings too)"
                )
            with torch.no_grad():
                model.get_output_embeddings().weight.mul_(cfg.lm_head_scale)
    else:
        path = resolve_local_path(cfg)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, device_map={"": device}, attn_implementation=cfg.attn_implementation
        )
        tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval().requires_grad_(False)
    return model, tokenizer


def resolve_local_path(cfg: TargetConfig) -> str:
    """A local HF directory; a GGUF file is converted once to a plain directory next to it."""
    if cfg.path in (None, "???"):
        raise ValueError(
            f"target {cfg.name!r}: target.path is not set; point it at a local directory "
            "with the target's weights (nothing is downloaded at run time)"
        )
    path = os.path.expanduser(str(cfg.path))
    if not os.path.exists(path):
        hint = ""
        if cfg.gguf_file:
            hint = " (fetch it with `bash ../shared/scripts/fetch_models.sh`)"
        raise FileNotFoundError(
            f"target.path={path!r} does not exist{hint}; set target.path to a "
            "local directory with the target's weights"
        )
    if not cfg.gguf_file:
        return path
    converted = os.path.join(path, "hf-" + os.path.splitext(os.path.basename(cfg.gguf_file))[0])
    if os.path.exists(os.path.join(converted, "config.json")):
        return converted
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = os.path.join(path, cfg.gguf_file)
    if not os.path.exists(gguf):
        raise FileNotFoundError(f"{gguf} not found; run `bash ../shared/scripts/fetch_models.sh`")
    t0 = time.perf_counter()
    print(
        f"target: converting {gguf} to a plain directory (once; ~1-2 min for a 0.5B model), "
        f"cached at {converted}",
        flush=True,
    )
    with _gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(
            path, gguf_file=cfg.gguf_file, dtype=torch.float32
        )
        tok = AutoTokenizer.from_pretrained(path, gguf_file=cfg.gguf_file)
    # The GGUF loader dequantizes every tensor to float32 but leaves its quantizer attached, which
    # makes save_pretrained refuse; the weights are plain tensors, so drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = converted + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, converted)
    except OSError:  # another process converted it first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.exists(os.path.join(converted, "config.json")):
            raise
    print(f"target: converted in {time.perf_counter() - t0:.0f} s", flush=True)
    return converted


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF file three times for one conversion (config, weights,
    tokenizer): 12 s each for Qwen2.5-Coder-0.5B on one CPU core, most of it the 151k-token
    vocabulary's strings. Within the block a file is parsed once and its reader (read-only
    memory-mapped views) reused."""
    try:
        import gguf
    except ImportError:  # transformers says what to install
        yield
        return
    parse, readers = gguf.GGUFReader, {}

    def reader(path, *args, **kwargs):
        key = (os.path.realpath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = parse


def load_target(
    cfg: TargetConfig,
    layer_ids: Sequence[int] | None = None,
    num_aux: int = 5,
    mask_token_id: int | None = None,
) -> Target:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    backend = select_linear_attn_backend(cfg.linear_attn_backend, device)
    model, tokenizer = load_hf_model(cfg, device, dtype)
    backend = check_bound_backend(model, backend)
    if backend == "fla":
        prepare_fla_kernels(model)
    num_layers = int(model.config.num_hidden_layers)
    ids = list(layer_ids) if layer_ids is not None else default_layer_ids(num_layers, num_aux)
    mtid = mask_token_id if mask_token_id is not None else cfg.mask_token_id
    target = Target(model, ids, tokenizer, mtid, backend, cfg.packed_capture, cfg.capture_graphs)
    target.compiled_layers = CompiledLayers.of(target, cfg.compile_layers, cfg.compile_gdn)
    return target
