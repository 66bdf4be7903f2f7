"""The frozen target's clean forward: aux-state capture and greedy labels (packed rows, CUDA
graphs, compiled layers: dflash.target.graphs).

Legend: N rows, T positions, K aux layers, H hidden size, V vocab.
Layer id l = output of decoder layer l = HF `hidden_states[l + 1]`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .graphs import CaptureGraphs, CompiledLayers, graphable
from .packing import attends_only, keeps_samples_apart
from .shape import TargetShape, check_layer_ids


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
        self.packs_capture = packed_capture and attends_only(model) and keeps_samples_apart(model)
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
        compiled: bool = True,
    ) -> TargetOutput:
        """One no-grad forward: aux states via hooks (only the K taps are kept), hard labels from
        the clean logits computed in chunks (the full [N, T, V] logits are never held).
        position_ids_NT restarting inside a row (no attention mask, no cache): packed samples,
        which transformers' attention masks keep apart. compiled=False: the eager layers even
        with target.compile_layers (the eval sets' one-row checks: a compile specialised to one
        row would be thrown away at the first training batch)."""
        layers = self.compiled_layers if compiled else None
        with self.tap_aux() as taps, CompiledLayers.active(layers):
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


def norm_gain(norm: nn.Module, dim: int) -> torch.Tensor:
    """A norm's per-channel gain (fp32, host): its output for a unit-RMS input of ones, whatever
    its parametrisation (`w`, or `1 + w` in Qwen3.5's zero-centred norm)."""
    w = norm.weight
    x = torch.ones(1, dim, device=w.device, dtype=w.dtype)
    return norm(x)[0].float().cpu()


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
