"""The packed target capture replayed from CUDA graphs (`target.capture_graphs`).

Legend: R packed rows, L row length, F = K*H aux features.

An eager forward of a small target (SmolLM2-135M, Qwen2.5-0.5B) over a few thousand tokens is
bound by kernel launches: ~30 kernels per layer, each costing more host time than GPU time.
Replayed from a CUDA graph the whole capture (forward, aux taps, argmax labels) is one launch.

Graphs have fixed shapes, so packed rows are padded to buckets: R up to a multiple of
`ROWS_TO`, L up to a multiple of `LEN_TO` (batch.pack_for_capture pads them); one graph per
bucket, captured the first time it is seen (at most `MAX_GRAPHS`; beyond that, eager). The
samples of a row are kept apart by an explicit block-diagonal causal mask built inside the graph
from the packed segment ids (padding is its own segment, so no attention row is empty), which
is why only targets whose layers are all full attention, run through SDPA, qualify.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from .linear_attn import kernels_outside_compile
from .regen import supports_static

ROWS_TO = 2
LEN_TO = 128
MAX_GRAPHS = 48


def graphable(model, device: torch.device) -> bool:
    """CUDA, SDPA, every layer full attention, as the static-cache decoder needs (a 4D mask
    given to transformers is used as is by every layer, so a sliding window would be lost)."""
    cfg = model.config
    return (
        device.type == "cuda"
        and getattr(cfg, "_attn_implementation", None) == "sdpa"
        and supports_static(model)
        and not getattr(cfg, "use_sliding_window", False)
    )


def packed_mask(seg_RL: torch.Tensor) -> torch.Tensor:
    """bool [R, 1, L, L]: query q sees key k iff same segment and k <= q (True = attend)."""
    L = seg_RL.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool, device=seg_RL.device).tril()
    return ((seg_RL[:, :, None] == seg_RL[:, None, :]) & causal)[:, None]


class CaptureGraphs:
    """One CUDA graph per (rows, length) bucket of `target.capture` over packed rows. Returns
    its TargetOutput, whose tensors are a graph's static outputs: read them before the next
    call."""

    buckets = (ROWS_TO, LEN_TO)

    def __init__(self, target):
        self.target = target
        self.graphs: dict = {}
        self.pool = None
        self.failed = False

    def __call__(self, ids_RL: torch.Tensor, pos_RL: torch.Tensor, seg_RL: torch.Tensor):
        key = tuple(ids_RL.shape)
        if key not in self.graphs and ids_RL.is_cuda and not self.failed:
            if len(self.graphs) < MAX_GRAPHS:  # beyond that, new buckets run eagerly
                self.graphs[key] = self._capture(ids_RL, pos_RL, seg_RL)  # None if it failed
        entry = self.graphs.get(key) if ids_RL.is_cuda else None
        if entry is None:  # CPU, a failed capture or too many buckets: the same forward, eager
            return self._eager(ids_RL, pos_RL, seg_RL)
        graph, (ids, pos, seg), out = entry
        ids.copy_(ids_RL, non_blocking=True)
        pos.copy_(pos_RL, non_blocking=True)
        seg.copy_(seg_RL, non_blocking=True)
        graph.replay()
        return out

    def _eager(self, ids_RL, pos_RL, seg_RL):
        return self.target.capture(ids_RL, packed_mask(seg_RL), position_ids_NT=pos_RL)

    def _capture(self, ids_RL, pos_RL, seg_RL):
        """Warm up on a side stream (lazy inits, cuBLAS workspaces), then record one capture."""
        static = tuple(x.clone() for x in (ids_RL, pos_RL, seg_RL))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(s):
                self._eager(*static)
            torch.cuda.current_stream().wait_stream(s)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=s):
                out = self._eager(*static)
            torch.cuda.current_stream().wait_stream(s)
        except RuntimeError as e:  # a model whose forward cannot be captured runs eagerly
            torch.cuda.synchronize()
            if not self.failed:
                print(
                    f"warning: CUDA graph capture of the target failed ({e}); capturing eagerly "
                    "(target.capture_graphs=false skips the attempt)",
                    file=sys.stderr,
                    flush=True,
                )
            self.failed = True
            return None
        return graph, static, out


# Sizes that happen to be equal at the first trace are not assumed equal for good ("duck
# sizing"): otherwise each coincidence becomes a guard, and the first capture without it compiles
# every layer again. Seen: the length of packed rows equal to the hidden size (tiny targets: the
# length was specialized to it), and the CUDA-graph capture's mask, a view of [R, L, L], whose
# base's L equal to the rows' length (the H100 run of 2026-12-05, at the packing check's
# unpacked capture). Read when a frame is traced, so set around each compiled call.
NO_DUCK_SHAPES = torch.fx.experimental._config.patch(use_duck_shape=False)


class CompiledLayers:
    """`target.compile_layers`: each decoder layer's forward `torch.compile`d (dynamic shapes; of
    a Gated-DeltaNet layer, its MLP or the whole layer: `units`),
    swapped in only for the clean capture: regeneration, eval decoding and the eval sets'
    one-row checks keep the eager layers (their shapes would compile again for nothing; on the
    H100 the one-row compile came first and the first training batch recompiled). Per layer, so
    the aux taps (forward hooks on the layers) stay outside the compiled code. A compile error
    warns once and the layers run eagerly from then on: the same forward, uncompiled."""

    BACKEND = "inductor"  # tests swap in "eager" (the same mechanics without a C++/Triton build)

    def __init__(self, layers):
        self.layers, self.failed = list(layers), False
        self.fns = [self._guarded(layer.forward) for layer in self.layers]
        self._pe = None  # (the shared position embeddings, rows, their copy): one per forward
        self._mask = None  # (the shared attention mask view, its copy): one per forward

    def _rows_matched(self, args, kwargs) -> dict:
        """kwargs with the inputs every layer shares made alike for packed and unpacked rows,
        once per forward (every layer gets the same copies), so that one graph serves both:
        - `position_embeddings` broadcast over the rows ([1, T, D]: unpacked rows share their
          positions; packed rows restart them, [R, T, D]) copied out to the rows' count (an
          expanded view would differ in strides). Dynamic shapes would otherwise guard on
          whether the two batch sizes are equal, and the first capture of the other kind
          compiles every layer again (the H200 run of 2026-12-05: "duck sizing added this
          equality" at the run-start packing check; both compiles were in its first step's
          13.7 s of target time).
        - an `attention_mask` that is a view (the CUDA-graph capture's [R, 1, L, L] of an
          [R, L, L] mask, transformers' of its own base) copied to a tensor of its own: the
          graph otherwise guards on the base's shape and strides, which differ between the two
          kinds (the H100 run of 2026-12-05)."""
        pe, h = kwargs.get("position_embeddings"), args[0] if args else kwargs.get("hidden_states")
        if not (torch.is_tensor(h) and h.dim() >= 2):
            return kwargs
        out = dict(kwargs)
        mask = kwargs.get("attention_mask")
        if torch.is_tensor(mask) and mask._base is not None:
            if self._mask is None or self._mask[0] is not mask:
                self._mask = (mask, mask.clone())
            out["attention_mask"] = self._mask[1]
        rows = h.shape[0]
        if isinstance(pe, tuple) and all(
            torch.is_tensor(t) and t.dim() == h.dim() and t.shape[0] == 1 != rows for t in pe
        ):
            if self._pe is None or self._pe[0] is not pe or self._pe[1] != rows:
                full = tuple(t.expand(rows, *t.shape[1:]).contiguous() for t in pe)
                self._pe = (pe, rows, full)
            out["position_embeddings"] = self._pe[2]
        return out

    @classmethod
    def of(cls, target, enabled: bool, gdn: str = "layer"):
        """CompiledLayers for a CUDA target when `enabled`, else None (CPU: eager, said once)."""
        if not enabled:
            return None
        if target.device.type != "cuda":
            print("note: target.compile_layers is for CUDA targets; this one runs eagerly")
            return None
        return cls(cls.units(target, gdn))

    @staticmethod
    def units(target, gdn: str = "layer") -> list:
        """What gets compiled: each attention decoder layer whole; of a Gated-DeltaNet layer the
        whole layer (`gdn="layer"`, its fla kernels called outside the compiled graphs:
        linear_attn.kernels_outside_compile) or its MLP only (`"mlp"`). The 27B forward at 4,096
        tokens on an H100: 0.449 s eager, 0.426 s mlp, 0.376 s layer (75.4 % of the matmul peak;
        torch 2.11, transformers 5.17, fla 0.6.0, 2026-12-05). Compiled whole with the kernels
        traced (before kernels_outside_compile), the layers ran transformers' torch fallback
        instead of the fla kernels: 0.84 s instead of 0.49 s eager on an H200."""
        if gdn not in ("mlp", "layer"):
            raise ValueError(f"target.compile_gdn={gdn!r}; choose mlp or layer")
        if gdn == "layer" and target.backend == "fla":
            mod = sys.modules.get(type(target.model).__module__)
            if mod is not None and not kernels_outside_compile(mod):
                raise ValueError(
                    "target.compile_gdn=layer: the Gated-DeltaNet kernels could not be kept out "
                    "of the compiled graphs; use target.compile_gdn=mlp"
                )
        return [
            layer.mlp
            if gdn == "mlp" and hasattr(layer, "linear_attn") and hasattr(layer, "mlp")
            else layer
            for layer in target.decoder_layers()
        ]

    def _guarded(self, eager):
        compiled = torch.compile(eager, dynamic=True, backend=self.BACKEND)

        def forward(*args, **kwargs):
            if not self.failed:
                try:
                    with NO_DUCK_SHAPES:
                        return compiled(*args, **self._rows_matched(args, kwargs))
                except torch._dynamo.exc.TorchDynamoException as e:
                    self.failed = True
                    print(
                        f"warning: target.compile_layers: compiling a decoder layer failed "
                        f"({type(e).__name__}: {str(e)[:200]}); the target runs eagerly",
                        file=sys.stderr,
                        flush=True,
                    )
            return eager(*args, **kwargs)

        return forward

    @staticmethod
    @contextlib.contextmanager
    def active(compiled: CompiledLayers | None):
        """The compiled forwards for the duration of one capture (nothing when None)."""
        if compiled is None:
            yield
            return
        for layer, fn in zip(compiled.layers, compiled.fns):
            layer.forward = fn
        try:
            yield
        finally:
            compiled._pe = compiled._mask = None
            for layer in compiled.layers:
                vars(layer).pop("forward", None)
