"""Packed target capture: which targets may run several samples in one row, and the one-time
check that packing gives what one sample per row gives (see batch.target_forward)."""

from __future__ import annotations

import sys

import torch
from torch import nn

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


def attends_only(model: nn.Module) -> bool:
    """Every decoder layer is (full, sliding or chunked) attention: no recurrent or convolution
    state that packed samples would share."""
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or getattr(
        getattr(cfg, "text_config", None), "layer_types", None
    )
    if types and any(t not in ATTENTION_LAYER_TYPES for t in types):
        return False
    stateful = ("linear_attn", "mamba", "mixer", "conv")
    return not any(hasattr(layer, a) for layer in model.get_decoder().layers for a in stateful)


def packed_capture_agrees(target, packed: list, ref: list, final_ref=None) -> bool:
    """The first packed capture against the same batch one sample per row ([aux, labels] of
    each, in the batch's layout). Packing stays on only if they agree: transformers keeps packed
    samples apart only where its attention masks follow the restarting position ids. In bf16
    (or with compiled layers) a label may flip where the top logits nearly tie: with the
    reference's final hidden states (final_ref), labels that differ count as agreeing when the
    packed label's logit is within 0.1 of the reference's top one."""
    target.pack_check_pending = False
    (aux, nxt), (aux_ref, nxt_ref) = packed, ref
    err = float((aux.float() - aux_ref.float()).norm() / aux_ref.float().norm().clamp(min=1e-9))
    agree = float((nxt == nxt_ref).float().mean())
    tol = 1e-4 if aux_ref.dtype == torch.float32 else 5e-2
    near = ""  # labels that differ only at near-ties (bf16 with the reference's final states)
    if (
        err <= tol
        and 0.9 <= agree < 0.98
        and final_ref is not None
        and aux_ref.dtype != torch.float32
    ):
        differ = nxt != nxt_ref
        head, a, b = target.lm_head, nxt_ref[differ], nxt[differ]
        w = head.weight  # the two logits in fp32 (bf16 logits of ~20 step by 0.125)
        gap = (final_ref[differ].float() * (w[a].float() - w[b].float())).sum(-1)
        if getattr(head, "bias", None) is not None:
            gap = gap + head.bias[a].float() - head.bias[b].float()
        if float(gap.max()) <= 0.1:
            near = f"; every differing label a near-tie, logit gap <= {float(gap.max()):.3f}"
    if err <= tol and (agree >= 0.98 or near):
        print(
            "target capture: samples packed into shared rows (first batch against one per row: "
            f"aux rel. diff {err:.1e}, labels agree {agree:.2%}{near})",
            flush=True,
        )
        return True
    target.packs_capture, target.capture_graphs = False, None
    print(
        f"warning: packed target capture differs from one sample per row (aux rel. diff "
        f"{err:.1e}, labels agree {agree:.2%}): capturing one sample per row "
        "(target.packed_capture=false skips this check)",
        file=sys.stderr,
        flush=True,
    )
    return False
