"""Real speculative decoding with the target verifying (batch size 1; greedy, and sampled in
`sampled`).

Modules: `cache` (transformers cache surgery), `steps` (result, target and drafter steps),
`chain` (AR baseline and chain decoding), `tree` (DDTree decoding), `sampled` (temperature /
top-p / top-k: `sample_ar` and `sample_chain` with rejection sampling, seeded).

Three decoders over the same HF target, all returning a `DecodeResult`:

- `generate_ar`: plain greedy decoding on the HF cache (the baseline, one token per forward).
- `generate_chain`: the z-lab `dflash_generate` loop. Prefill the target (aux states of the
  prompt captured by hooks on the aux layers, as `Target.capture` does), first token = argmax.
  Each round the drafter gets the block [bonus, MASK x (B-1)] at positions start..start+B-1 and
  a context of the aux features of all positions < start, kept as per-layer K/V
  (`DFlashDrafter.context_kv`) that only grows by the accepted positions. The drafted tokens
  (the drafter's rule at block positions 1..B-1: DFlash each position's argmax, DFlash2 its
  selector's path) are verified in ONE target forward on its cache; accepted =
  leading matches of the draft with the target's argmax, the next bonus is the target's argmax
  at the first miss (or after the last draft), and the target cache is rolled back to the
  accepted length.
- `generate_tree`: DDTree. The best-`budget` tree of the drafter's per-position log-probs
  (`dflash.decoding.ddtree.build_ddtree`) is verified in one forward with depth-based positions and an
  ancestor-only 4D mask; the longest path matching the target's argmax is accepted and the
  attention cache is gathered to prefix + accepted path.

Cache rollback
--------------
Attention layers (`DynamicLayer`) roll back by cropping (chain) or gathering (tree) K/V along
the sequence. Gated-DeltaNet layers (`LinearAttentionLayer`: `conv_states[0]` = last
conv-kernel inputs, `recurrent_states[0]` = the delta-rule state, both updated *in place* by
a forward) cannot: `DynamicCache.crop()` raises on them unless `activate_past_recording()` was
called, and even then it only rolls back the conv window, never the recurrent state. So:

- chain on a hybrid target: the linear layers' conv/recurrent states are snapshotted (cloned)
  before the verify forward; on a partial acceptance they are restored, the attention layers
  are cropped back to the pre-verify length, and the accepted tokens (bonus + accepted drafts)
  are re-run through the target. Extra cost: one forward of accepted+1 tokens per round that
  does not accept the whole block (rounds that accept all B-1 drafts need no rollback).
- tree on a hybrid target: a recurrent layer cannot run a tree as one sequence, so every
  root-to-leaf path of the tree is verified as one row of a batch of chains (from a
  batch-expanded copy of the cache; the committed cache is not touched), the accepted path is
  found from the per-node argmaxes, and then the accepted tokens are run once on the committed
  cache. Cost per round: (#leaves) x (1 + max depth) verify tokens (vs 1 + budget for a real
  tree forward) plus a batch copy of the attention K/V, plus one forward of accepted+1 tokens.

The naive alternative, transformers' `activate_past_recording()` + `cache.crop(-n)`, rolls
back the conv window but not the recurrent state; it lives in `dflash.tools.testing.CropRollback`
only to show that it departs from greedy decoding on hybrid targets.

End-of-generation convention: at most `max_new_tokens` tokens are produced; in the last round
acceptance is capped at the number of tokens still needed (remaining = max_new_tokens -
generated). This is the offline walk's convention (`dflash.eval.metrics.walk_chain`: avail =
min(D, L-1-i)), so a run with max_new_tokens = L visits the same rounds as the offline walk
of an L-token completion.

Numerics: "identical to greedy" holds up to floating-point near-ties. Verification runs B
tokens (on hybrid targets through the chunked Gated-DeltaNet kernel), AR decoding one token at
a time (the recurrent kernel), and a tree forward uses a masked attention over extra keys; if
the target's top-2 logits are closer than that arithmetic noise, the two can pick different
tokens. Greedy tokens come from the decoder's last hidden state through `lm_head` in chunks
(`Target.greedy_from_hidden`, the path of the training labels), never the full logits.

Legend: P prompt length, B block size, D = B-1 drafted positions, b tree budget, V vocab.
"""

from __future__ import annotations

from ..target.cache import is_hybrid_cache, new_cache
from .chain import ExactRollback, generate_ar, generate_chain
from .sampled import Sampling, sample_ar, sample_chain
from .steps import DecodeResult
from .tree import generate_tree

__all__ = [
    "DecodeResult",
    "ExactRollback",
    "generate_ar",
    "generate_chain",
    "generate_tree",
    "is_hybrid_cache",
    "new_cache",
    "Sampling",
    "sample_ar",
    "sample_chain",
]
