"""The frozen target: loading, Gated-DeltaNet backend selection, aux-state capture.

Legend: N rows, T positions, K aux layers, H hidden size, V vocab.
Layer id l = output of decoder layer l = HF `hidden_states[l + 1]`.
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from .config import TargetConfig

_GDN_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",
                "transformers.models.qwen3_next.modeling_qwen3_next")
_GDN_FUNCS = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
              "causal_conv1d_fn", "causal_conv1d_update")


# ----------------------------------------------------------------------------- backend selection
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def select_linear_attn_backend(backend: str, device: torch.device) -> str:
    """Decide the Gated-DeltaNet implementation before transformers imports its modeling code.

    transformers (>= 5.15) binds fla kernels at import of the modeling module if `fla` imports,
    with no device check; on a CPU-only machine with fla + triton the forward then crashes. So
    `torch` hides fla from the import system, and `fla` is refused without CUDA.
    Returns the resolved choice ("fla" or "torch").
    """
    if backend not in ("auto", "fla", "torch"):
        raise ValueError(f"target.linear_attn_backend={backend!r}; choose auto, fla or torch")
    if backend == "auto":
        backend = "fla" if device.type == "cuda" and _fla_importable() else "torch"
    if backend == "fla":
        if device.type != "cuda" or not torch.cuda.is_available():
            raise ValueError("target.linear_attn_backend=fla needs a CUDA device (fla kernels are "
                             "Triton GPU kernels); use linear_attn_backend=torch on CPU")
        if not _fla_importable():
            raise ValueError("target.linear_attn_backend=fla but flash-linear-attention is not "
                             "installed; `pip install 'dflash[gpu]'` or use linear_attn_backend=torch")
    already = [m for m in _GDN_MODULES if m in sys.modules]
    for mod in already:
        current = linear_attn_report(sys.modules[mod]).get("chunk_gated_delta_rule", "")
        if ("fla" in current) != (backend == "fla"):
            raise RuntimeError(
                f"{mod} was imported with the {'fla' if 'fla' in current else 'torch'} Gated-DeltaNet "
                f"kernels before dflash could select {backend!r}; select the backend before importing "
                "the model (use dflash.target.load_target) or start a fresh process")
    if backend == "torch":
        sys.modules.setdefault("fla", None)  # makes `import fla` raise ImportError
        sys.modules.setdefault("causal_conv1d", None)
    return backend


def _fla_importable() -> bool:
    if "fla" in sys.modules:
        return sys.modules["fla"] is not None
    try:
        import importlib.util
        return importlib.util.find_spec("fla") is not None
    except (ImportError, ValueError):
        return False


def linear_attn_report(module=None) -> dict:
    """Which implementation each Gated-DeltaNet op of an imported modeling module is bound to."""
    mods = [module] if module is not None else [sys.modules[m] for m in _GDN_MODULES if m in sys.modules]
    report = {}
    for mod in mods:
        for name in _GDN_FUNCS:
            fn = getattr(mod, name, None)
            if fn is None:
                continue
            impl = fn
            for cell in getattr(fn, "__closure__", None) or ():
                c = cell.cell_contents
                if callable(c) and getattr(c, "__name__", "") in (name, f"torch_{name}") or (
                        callable(c) and getattr(c, "__module__", "").startswith(("fla", "causal_conv1d"))):
                    impl = c
            report[name] = f"{getattr(impl, '__module__', '?')}.{getattr(impl, '__name__', '?')}"
    return report


# ----------------------------------------------------------------------------- loading
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
    if cfg.config is not None:
        hf_cfg = build_hf_config(cfg.config)
        if cfg.init_std is not None:
            hf_cfg.initializer_range = cfg.init_std
        torch.manual_seed(cfg.init_seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype,
                                                     attn_implementation=cfg.attn_implementation)
    else:
        path = resolve_local_path(cfg)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map={"": device},
                                                     attn_implementation=cfg.attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(path)
    model.eval().requires_grad_(False)
    return model, tokenizer


def resolve_local_path(cfg: TargetConfig) -> str:
    """A local HF directory; a GGUF file is converted once to a plain directory next to it."""
    path = os.path.expanduser(str(cfg.path))
    if not os.path.exists(path):
        hint = ""
        if cfg.gguf_file:
            hint = " (fetch it with `bash ../shared/scripts/fetch_models.sh`)"
        raise FileNotFoundError(f"target.path={path!r} does not exist{hint}; set target.path to a "
                                "local directory with the target's weights")
    if not cfg.gguf_file:
        return path
    converted = os.path.join(path, "hf")
    if os.path.exists(os.path.join(converted, "config.json")):
        return converted
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = os.path.join(path, cfg.gguf_file)
    if not os.path.exists(gguf):
        raise FileNotFoundError(f"{gguf} not found; run `bash ../shared/scripts/fetch_models.sh`")
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=cfg.gguf_file, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path, gguf_file=cfg.gguf_file)
    tmp = converted + f".tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, converted)
    return converted


def default_layer_ids(num_target_layers: int, num_aux: int) -> list[int]:
    """Evenly spaced over 1..L-3 (z-lab's rule): [1, 16, 31, 46, 61] for 64 layers, 5 aux."""
    if num_aux == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_aux - 1))) for i in range(num_aux)]


def check_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Refuse the shortcut (pitfall 2) and out-of-range ids."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("drafter.target_layer_ids is empty; give at least one target layer id")
    bad = [i for i in ids if i < 0 or i >= num_target_layers]
    if bad:
        raise ValueError(f"drafter.target_layer_ids {bad} out of range for a target with "
                         f"{num_target_layers} layers (valid: 0..{num_target_layers - 2})")
    if num_target_layers - 1 in ids:
        raise ValueError(
            f"drafter.target_layer_ids contains {num_target_layers - 1}, the target's final layer: "
            "its output produces the target logits, so the drafter would learn a shortcut that does "
            f"not exist at inference. Use ids <= {num_target_layers - 2} (default: evenly spaced over "
            f"1..{num_target_layers - 3})")
    if len(set(ids)) != len(ids):
        raise ValueError(f"drafter.target_layer_ids has duplicates: {ids}")
    return ids


# ----------------------------------------------------------------------------- capture
@dataclass
class TargetOutput:
    """What one clean (un-noised) target forward yields.

    aux_NTF: concat of the K aux layers' outputs, F = K*H. next_token_NT: the target's greedy
    prediction for position t+1 (argmax of the clean logits at t): the hard labels.
    final_hidden_NTH: the last normed hidden state (only for an explicit soft loss).
    """
    aux_NTF: torch.Tensor
    next_token_NT: torch.Tensor
    final_hidden_NTH: Optional[torch.Tensor] = None


class Target(nn.Module):
    """Frozen HF causal LM + the aux layers the drafter reads."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], tokenizer=None,
                 mask_token_id: Optional[int] = None, backend: str = "torch"):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.backend = backend
        self.num_layers = int(model.config.num_hidden_layers)
        self.layer_ids = check_layer_ids(layer_ids, self.num_layers)
        self.hidden_size = int(model.config.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.mask_token_id = resolve_mask_token_id(tokenizer, self.vocab_size, mask_token_id)

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.get_decoder().layers

    @torch.no_grad()
    def capture(self, input_ids_NT: torch.Tensor, attention_mask_NT: Optional[torch.Tensor] = None,
                with_final_hidden: bool = False, label_chunk: int = 4096) -> TargetOutput:
        """One no-grad forward: aux states via hooks (only the K taps are kept), hard labels from
        the clean logits computed in chunks (the full [N, T, V] logits are never held)."""
        captured: dict[int, torch.Tensor] = {}
        layers = self.decoder_layers()
        handles = []
        for lid in self.layer_ids:
            def hook(_mod, _inp, out, lid=lid):
                captured[lid] = out[0] if isinstance(out, (tuple, list)) else out
            handles.append(layers[lid].register_forward_hook(hook))
        try:
            out = self.model.get_decoder()(input_ids=input_ids_NT, attention_mask=attention_mask_NT,
                                           use_cache=False)
        finally:
            for h in handles:
                h.remove()
        final_NTH = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        aux_NTF = torch.cat([captured[lid] for lid in self.layer_ids], dim=-1)
        next_token_NT = self.greedy_from_hidden(final_NTH, label_chunk)
        return TargetOutput(aux_NTF, next_token_NT, final_NTH if with_final_hidden else None)

    def greedy_from_hidden(self, final_NTH: torch.Tensor, chunk: int) -> torch.Tensor:
        flat = final_NTH.reshape(-1, final_NTH.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for i in range(0, flat.shape[0], chunk):
            out[i:i + chunk] = self.lm_head(flat[i:i + chunk]).argmax(-1)
        return out.view(final_NTH.shape[:-1])


def resolve_mask_token_id(tokenizer, vocab_size: int, requested: Optional[int]) -> int:
    if requested is not None:
        mid = int(requested)
    elif tokenizer is None:
        mid = vocab_size - 1  # tokenizer-less random targets: reserve the last id
    elif getattr(tokenizer, "mask_token_id", None) is not None:
        mid = int(tokenizer.mask_token_id)
    else:
        raise ValueError(
            "the target's tokenizer has no mask token; set target.mask_token_id to a special token "
            "id that never occurs in text (e.g. an unused reserved/FIM token), or add one with "
            "tokenizer.add_special_tokens({'mask_token': '<|MASK|>'}) and save the tokenizer "
            "(the id must be < the embedding size)")
    if not 0 <= mid < vocab_size:
        raise ValueError(f"mask token id {mid} is outside the target's embedding (vocab {vocab_size}); "
                         "set target.mask_token_id to an id < vocab size")
    return mid


def load_target(cfg: TargetConfig, layer_ids: Optional[Sequence[int]] = None, num_aux: int = 5,
                mask_token_id: Optional[int] = None) -> Target:
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    backend = select_linear_attn_backend(cfg.linear_attn_backend, device)
    model, tokenizer = load_hf_model(cfg, device, dtype)
    num_layers = int(model.config.num_hidden_layers)
    ids = list(layer_ids) if layer_ids is not None else default_layer_ids(num_layers, num_aux)
    mtid = mask_token_id if mask_token_id is not None else cfg.mask_token_id
    return Target(model, ids, tokenizer, mtid, backend)
