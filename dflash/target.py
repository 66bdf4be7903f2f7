"""The frozen target: loading and aux-state capture (Gated-DeltaNet kernels: dflash.linear_attn).

Legend: N rows, T positions, K aux layers, H hidden size, V vocab.
Layer id l = output of decoder layer l = HF `hidden_states[l + 1]`.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .capture_graphs import CaptureGraphs, CompiledLayers, graphable
from .config import TargetConfig
from .linear_attn import check_bound_backend, select_linear_attn_backend
from .packing import attends_only
from .shape import TargetShape


# ----------------------------------------------------------------------------- backend selection
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


# ----------------------------------------------------------------------------- loading
CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


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
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file=cfg.gguf_file, dtype=torch.float32)
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
    return converted


def default_layer_ids(num_target_layers: int, num_aux: int) -> list[int]:
    """Evenly spaced over 1..L-3 (z-lab's rule): [1, 16, 31, 46, 61] for 64 layers, 5 aux."""
    if num_aux == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_aux - 1))) for i in range(num_aux)]


def check_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Refuse out-of-range ids and the final layer (its output is the target's logits: a
    shortcut that does not exist at inference)."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise ValueError("drafter.target_layer_ids is empty; give at least one target layer id")
    bad = [i for i in ids if i < 0 or i >= num_target_layers]
    if bad:
        raise ValueError(
            f"drafter.target_layer_ids {bad} out of range for a target with "
            f"{num_target_layers} layers (valid: 0..{num_target_layers - 2})"
        )
    if num_target_layers - 1 in ids:
        raise ValueError(
            f"drafter.target_layer_ids contains {num_target_layers - 1}, the target's final layer: "
            "its output produces the target logits, so the drafter would learn a shortcut that does "
            f"not exist at inference. Use ids <= {num_target_layers - 2} (default: evenly spaced over "
            f"1..{num_target_layers - 3})"
        )
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
    final_hidden_NTH: torch.Tensor | None = None


class _AuxTaps:
    def __init__(self, layer_ids):
        self.layer_ids, self.captured = list(layer_ids), {}

    def hook(self, lid: int):
        def fn(_mod, _inp, out):
            self.captured[lid] = out[0] if isinstance(out, (tuple, list)) else out

        return fn

    def aux(self) -> torch.Tensor | None:
        if not self.captured:
            return None
        return torch.cat([self.captured[lid] for lid in self.layer_ids], dim=-1)


class Target(nn.Module):
    """Frozen HF causal LM + the aux layers the drafter reads."""

    def __init__(
        self,
        model: nn.Module,
        layer_ids: Sequence[int],
        tokenizer=None,
        mask_token_id: int | None = None,
        backend: str = "torch",
        packed_capture: bool = False,
        capture_graphs: bool = False,
    ):
        super().__init__()
        self.model = model
        # samples packed into shared rows for the clean forward: only where every layer attends
        # (a recurrence would carry state across samples); checked once against one per row
        self.packs_capture = packed_capture and attends_only(model)
        self.pack_check_pending = self.packs_capture
        self.tokenizer = tokenizer
        self.backend = backend
        self.num_layers = int(model.config.num_hidden_layers)
        self.layer_ids = check_layer_ids(layer_ids, self.num_layers)
        self.hidden_size = int(model.config.hidden_size)
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.mask_token_id = resolve_mask_token_id(tokenizer, self.vocab_size, mask_token_id)
        graphs = capture_graphs and self.packs_capture and graphable(model, self.device)
        self.capture_graphs = CaptureGraphs(self) if graphs else None  # packed, CUDA graphs
        self.compiled_layers: CompiledLayers | None = None  # target.compile_layers (load_target)

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

    @property
    def shape(self) -> TargetShape:
        return TargetShape.from_hf_config(
            self.model.config,
            vocab_size=self.vocab_size,
            dtype=self.dtype,
            mask_token_id=self.mask_token_id,
            layer_ids=self.layer_ids,
        )

    @torch.no_grad()
    def final_norm_gain(self) -> torch.Tensor:
        """The final norm's per-channel gain (fp32, host): its output for a unit-RMS input of
        ones, whatever its parametrisation (`w`, or `1 + w` in Qwen3.5's zero-centred norm)."""
        from .warmstart import norm_gain

        return norm_gain(self.model.get_decoder().norm, self.hidden_size)

    def decoder_layers(self) -> nn.ModuleList:
        return self.model.get_decoder().layers

    @torch.no_grad()
    def capture(
        self,
        input_ids_NT: torch.Tensor,
        attention_mask_NT: torch.Tensor | None = None,
        with_final_hidden: bool = False,
        label_chunk: int = 4096,
        position_ids_NT: torch.Tensor | None = None,
    ) -> TargetOutput:
        """One no-grad forward: aux states via hooks (only the K taps are kept), hard labels from
        the clean logits computed in chunks (the full [N, T, V] logits are never held).
        position_ids_NT restarting inside a row (no attention mask, no cache): packed samples,
        which transformers' attention masks keep apart."""
        with self.tap_aux() as taps, CompiledLayers.active(self.compiled_layers):
            out = self.model.get_decoder()(
                input_ids=input_ids_NT,
                attention_mask=attention_mask_NT,
                position_ids=position_ids_NT,
                use_cache=False,
            )
        final_NTH = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        aux_NTF = taps.aux()
        next_token_NT = self.greedy_from_hidden(final_NTH, label_chunk)
        return TargetOutput(aux_NTF, next_token_NT, final_NTH if with_final_hidden else None)

    @contextlib.contextmanager
    def tap_aux(self, enabled: bool = True):
        """Forward hooks on the aux layers for the duration of one forward; `.aux()` then returns
        their outputs concatenated in layer-id order [N, T, K*H] (None when disabled)."""
        taps = _AuxTaps(self.layer_ids)
        handles = [
            self.decoder_layers()[lid].register_forward_hook(taps.hook(lid))
            for lid in (self.layer_ids if enabled else [])
        ]
        try:
            yield taps
        finally:
            for h in handles:
                h.remove()

    def greedy_from_hidden(self, final_NTH: torch.Tensor, chunk: int) -> torch.Tensor:
        flat = final_NTH.reshape(-1, final_NTH.shape[-1])
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        for i in range(0, flat.shape[0], chunk):
            out[i : i + chunk] = self.lm_head(flat[i : i + chunk]).argmax(-1)
        return out.view(final_NTH.shape[:-1])


def resolve_mask_token_id(tokenizer, vocab_size: int, requested: int | None) -> int:
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
            "(the id must be < the embedding size)"
        )
    if not 0 <= mid < vocab_size:
        raise ValueError(
            f"mask token id {mid} is outside the target's embedding (vocab {vocab_size}); "
            "set target.mask_token_id to an id < vocab size"
        )
    return mid


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
    num_layers = int(model.config.num_hidden_layers)
    ids = list(layer_ids) if layer_ids is not None else default_layer_ids(num_layers, num_aux)
    mtid = mask_token_id if mask_token_id is not None else cfg.mask_token_id
    target = Target(model, ids, tokenizer, mtid, backend, cfg.packed_capture, cfg.capture_graphs)
    target.compiled_layers = CompiledLayers.of(target, cfg.compile_layers)
    return target
