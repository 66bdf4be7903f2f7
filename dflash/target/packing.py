"""Packed target capture: which targets may run several samples in one row, and the one-time
check that packing gives what one sample per row gives (see batch.target_forward).

transformers keeps packed samples apart by building its attention masks from the restarting
position ids. sdpa, eager and flex attention do that for any number of rows; the flash-attention
kernels follow the restarting positions for a single row only, so with two or more packed rows
samples attend across each other. Packing is therefore on only for the first three, and the
check runs on the first batch that has a row shared by two samples (a batch of one sample per
row compares equal whatever the kernel does), on those rows' positions."""

from __future__ import annotations

import sys

import torch
from torch import nn

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# attention implementations whose masks follow restarting position ids in every row
KEEPS_SAMPLES_APART = ("sdpa", "eager", "flex_attention")


def keeps_samples_apart(model: nn.Module) -> bool:
    """The target's attention implementation keeps packed samples apart (see module doc)."""
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    if impl in KEEPS_SAMPLES_APART:
        return True
    print(
        f"target capture: one sample per row: attention implementation {impl!r} lets packed "
        f"samples attend across each other when a batch has several rows (packing needs one of "
        f"{', '.join(KEEPS_SAMPLES_APART)}: target.attn_implementation)",
        file=sys.stderr,
        flush=True,
    )
    return False


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


def packed_capture_agrees(
    target, packed: list, ref: list, final_ref=None, compared_NT=None
) -> bool:
    """The first packed capture with a shared row against the same batch one sample per row
    ([aux, labels] of each, in the batch's layout), on the positions of compared_NT (the samples
    that shared a row; None: all). Packing stays on only if they agree: transformers keeps
    packed samples apart only where its attention masks follow the restarting position ids. In
    bf16 (or with compiled layers) a label may flip where the top logits nearly tie: with the
    reference's final hidden states (final_ref), labels that differ count as agreeing when the
    packed label's logit is within 0.1 of the reference's top one."""
    target.pack_check_pending = False
    (aux, nxt), (aux_ref, nxt_ref) = packed, ref
    if compared_NT is not None:
        aux, nxt, aux_ref, nxt_ref = (x[compared_NT] for x in (aux, nxt, aux_ref, nxt_ref))
        final_ref = final_ref[compared_NT] if final_ref is not None else None
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
            "target capture: samples packed into shared rows (first batch with a shared row "
            f"against one per row: aux rel. diff {err:.1e}, labels agree {agree:.2%}{near})",
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
