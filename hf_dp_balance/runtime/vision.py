"""Balance the vision encoder's compute across data-parallel ranks, inside the forward pass.

`balance_vision_encoder(model)` wraps the vision tower of a Qwen2-VL,
Qwen2.5-VL, Qwen3-VL or InternVL model in place (forward hooks; no model code
changes). On every training forward, on every rank of the group:

1. gather the grid (t, h, w) of every image / video (InternVL: every tile) of
   every rank (two small all_gathers);
2. plan with `plan_balance` over the items' vision costs (identical on every
   rank: same metadata, deterministic planner); skip when the predicted gain is
   below `config.min_gain` -- then nothing else is sent and every rank runs its
   own images exactly as without the wrapper;
3. all_to_all the pixel rows (tiles) to the planned ranks;
4. run the real vision tower on the received items (Qwen: one call with the
   concatenated grids; attention, the patch merger and Qwen2.5-VL's window
   index are all per item, so the result of an item does not depend on which
   other items share the call);
5. all_to_all the embeddings (Qwen3-VL: with the deepstack features, as extra
   columns of the same rows) back to the owner rank, differentiable: in the
   backward the gradients travel the reverse way to the rank that computed the
   item, and the vision parameters' gradients land there.

The result is handed to the model as its own `mm_encoder_outputs` argument
(transformers 5.x), so the model's placeholder scatter, mrope positions and
deepstack injection run unchanged.

The rule that keeps every rank in every collective: the balanced path runs on
every rank at every forward in training mode, whether or not the rank's batch
has images (a rank with none gathers zero items and still joins each
all_to_all), and the returned embeddings are tied to the decoder's input
embeddings by an identity autograd node (`_TieGradient`), so the backward
all_to_all runs on every rank even where the rank received no rows. In eval
mode (generation: ranks call forward a different number of times) and without
an initialised process group of size > 1 the wrapper does nothing.
"""

from __future__ import annotations

import collections
import datetime
import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = [
    "balance_vision_encoder",
    "VisionBalancer",
    "VisionRoute",
    "route_items",
    "item_costs",
]

logger = logging.getLogger(__name__)
# Per-forward stats kept until popped; older ones are dropped if nobody pops them.
_MAX_STATS = 1024


# --------------------------------------------------------------------------- pure core


def item_costs(grids: np.ndarray, cost_model) -> np.ndarray:
    """Vision cost of each item from its grid rows (t, h, w).

    Qwen-VL vision attention is per frame (cu_seqlens repeat h*w t times), so an
    item costs t * cost(h*w); an InternVL tile is one frame of (S/p)^2 patches.
    """
    grids = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    if grids.size and (grids <= 0).any():
        bad = int(np.nonzero((grids <= 0).any(axis=1))[0][0])
        raise ValueError(f"item {bad}: grid {grids[bad].tolist()} has a non-positive entry")
    frames = grids[:, 0].astype(np.float64)
    patches_per_frame = grids[:, 1] * grids[:, 2]
    return frames * cost_model.sample_costs(patches_per_frame)


@dataclass(frozen=True)
class VisionRoute:
    """Where one rank's rows go and come from, for one balanced forward.

    Items are numbered globally rank-major (all items of rank 0, then rank 1...).
    Items planned to stay on their owner (kept) take no part in either
    all_to_all: their pixel rows are used in place and their embeddings never
    leave the rank. Only moved items are exchanged. A rank computes its kept
    items first (local order), then the received ones in arrival order (by
    source rank, then the source's local order); the tower's result per item
    does not depend on which other items share the call.

    kept_items:      local indices of the items computed where they are, in local order
    send_order:      local indices of the moved items in the order they are sent (stable by destination)
    send_in_rows:    pixel rows sent to each rank            (forward, pixels; moved items only)
    recv_in_rows:    pixel rows received from each rank      (forward, pixels)
    computed_items:  global indices of the items this rank computes, in compute order (kept, then received)
    send_out_rows:   embedding rows sent back to each rank   (= rows of received items per owner)
    recv_out_rows:   embedding rows received from each rank  (= rows of own moved items per computing rank)
    restore_rows:    row index into [kept items' embedding rows; received embedding rows] that
                     gives this rank's embedding rows in local item order
    """

    kept_items: np.ndarray
    send_order: np.ndarray
    send_in_rows: List[int]
    recv_in_rows: List[int]
    computed_items: np.ndarray
    send_out_rows: List[int]
    recv_out_rows: List[int]
    restore_rows: np.ndarray

    @property
    def exchanges(self) -> bool:
        """Whether this rank sends or receives any row (it still joins every collective)."""
        return bool(sum(self.send_in_rows) or sum(self.recv_in_rows))


def route_items(item_rank: np.ndarray, item_dest: np.ndarray, in_rows: np.ndarray, out_rows: np.ndarray,
                rank: int, num_ranks: int) -> VisionRoute:
    """Split sizes and permutations of the two all_to_alls of one balanced forward (pure, O(n log n)).

    `item_rank` (owner of each global item) must be non-decreasing (rank-major
    numbering); `item_dest` the planned rank; `in_rows` / `out_rows` the pixel
    rows and embedding rows of each item. Kept items (dest == owner) are
    left out of the exchanges, so the bytes sent are those of moved items only.
    """
    item_rank = np.asarray(item_rank, dtype=np.int64)
    item_dest = np.asarray(item_dest, dtype=np.int64)
    in_rows = np.asarray(in_rows, dtype=np.int64)
    out_rows = np.asarray(out_rows, dtype=np.int64)
    n = item_rank.shape[0]
    for name, arr in (("item_dest", item_dest), ("in_rows", in_rows), ("out_rows", out_rows)):
        if arr.shape != (n,):
            raise ValueError(f"{name} has shape {arr.shape}, expected ({n},) like item_rank")
    if n and (np.diff(item_rank) < 0).any():
        raise ValueError("item_rank must be non-decreasing (items numbered rank-major)")
    for name, arr in (("item_rank", item_rank), ("item_dest", item_dest)):
        if n and ((arr < 0) | (arr >= num_ranks)).any():
            bad = int(np.nonzero((arr < 0) | (arr >= num_ranks))[0][0])
            raise ValueError(f"item {bad}: {name}={int(arr[bad])} is not a rank in [0, {num_ranks})")

    mine = np.nonzero(item_rank == rank)[0]
    my_dest = item_dest[mine]
    kept = np.nonzero(my_dest == rank)[0]
    moved = np.nonzero(my_dest != rank)[0]
    send_order = moved[np.argsort(my_dest[moved], kind="stable")]
    send_in_rows = np.bincount(my_dest[moved], weights=in_rows[mine[moved]], minlength=num_ranks).astype(np.int64)
    recv_out_rows = np.bincount(my_dest[moved], weights=out_rows[mine[moved]], minlength=num_ranks).astype(np.int64)

    received = np.nonzero((item_dest == rank) & (item_rank != rank))[0]
    src = item_rank[received]
    recv_in_rows = np.bincount(src, weights=in_rows[received], minlength=num_ranks).astype(np.int64)
    send_out_rows = np.bincount(src, weights=out_rows[received], minlength=num_ranks).astype(np.int64)

    # Embedding rows of this rank's items sit in [kept rows (local order); rows
    # back from the computing ranks (grouped by rank, each group in send order)].
    my_out = out_rows[mine]
    start = np.zeros(mine.shape[0], dtype=np.int64)
    kept_total = int(my_out[kept].sum())
    start[kept] = np.cumsum(my_out[kept]) - my_out[kept]
    start[send_order] = kept_total + np.cumsum(my_out[send_order]) - my_out[send_order]
    restore_rows = _ranges(start, my_out)
    return VisionRoute(kept_items=kept.astype(np.int64), send_order=send_order.astype(np.int64),
                       send_in_rows=send_in_rows.tolist(), recv_in_rows=recv_in_rows.tolist(),
                       computed_items=np.concatenate([mine[kept], received]).astype(np.int64),
                       send_out_rows=send_out_rows.tolist(), recv_out_rows=recv_out_rows.tolist(),
                       restore_rows=restore_rows)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], starts[i] + counts[i]) (vectorised)."""
    starts = np.asarray(starts, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    # position within the output minus the offset of its range, plus the range's start
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)


def rows_in_order(row_counts: Sequence[int], order: np.ndarray) -> np.ndarray:
    """Row index gathering whole items (each `row_counts[i]` consecutive rows) in `order`."""
    counts = np.asarray(row_counts, dtype=np.int64)
    starts = np.cumsum(counts) - counts
    order = np.asarray(order, dtype=np.int64)
    return _ranges(starts[order], counts[order])


def _take_rows(parts: Sequence[torch.Tensor], rows: np.ndarray, empty: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of the row-wise concatenation of `parts`, without building that concatenation.

    A run of consecutive rows inside one part is a view (no copy); other runs
    are one index_select each; the pieces are joined by one cat only when there
    are several. `empty` is returned when `rows` is empty.
    """
    rows = np.asarray(rows, dtype=np.int64)
    if rows.size == 0:
        return empty
    ends = np.cumsum([p.shape[0] for p in parts])
    part_of = np.searchsorted(ends, rows, side="right")
    cuts = np.concatenate([[0], np.nonzero(np.diff(part_of))[0] + 1, [rows.size]])
    pieces = []
    for a, b in zip(cuts[:-1], cuts[1:]):
        k = int(part_of[a])
        part = parts[k]
        local = rows[a:b] - (ends[k] - part.shape[0])
        if local[-1] - local[0] + 1 == local.size and (local.size == 1 or (np.diff(local) == 1).all()):
            pieces.append(part[int(local[0]):int(local[-1]) + 1])
        else:
            pieces.append(part.index_select(0, torch.from_numpy(local).to(part.device)))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


# --------------------------------------------------------------------------- autograd pieces


class _TieGradient(torch.autograd.Function):
    """Identity on `x` that makes `deps` part of x's autograd graph (their gradient is zero).

    Ties the returned embeddings to the decoder's input so that the backward
    all_to_all runs on every rank, also on one whose embeddings are empty.
    """

    @staticmethod
    def forward(ctx, x, *deps):
        ctx.dep_meta = [(d.shape, d.dtype, d.device) for d in deps]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros(s, dtype=t, device=d) for s, t, d in ctx.dep_meta)


# --------------------------------------------------------------------------- family adapters


@dataclass
class _LocalItems:
    """The vision items of one rank's forward, in the model's order (images, then videos)."""

    pixel_parts: List[torch.Tensor]  # [rows, row_width] each in the tower's dtype (images, videos): never joined
    grids: np.ndarray  # [n, 3] int64
    in_rows: np.ndarray  # pixel rows per item
    out_rows: np.ndarray  # embedding rows per item
    kinds: List[str] = field(default_factory=list)  # "image" / "video" per item


class _QwenTower:
    """Qwen2-VL / Qwen2.5-VL / Qwen3-VL: items are images and videos; pixel rows are patches."""

    def __init__(self, inner, family: str):
        self.inner, self.family = inner, family
        vc = inner.config.vision_config
        self.merge = int(vc.spatial_merge_size)
        self.row_width = int(vc.in_channels) * int(vc.temporal_patch_size) * int(vc.patch_size) ** 2
        self.embed_width = int(vc.hidden_size if family == "qwen2_vl" else vc.out_hidden_size)
        self.n_deepstack = len(getattr(vc, "deepstack_visual_indexes", None) or []) if family == "qwen3_vl" else 0
        self.out_width = self.embed_width * (1 + self.n_deepstack)

    @property
    def module(self):
        return self.inner.visual

    def local_items(self, kwargs: dict, rank: int) -> Tuple[Optional[_LocalItems], List[str]]:
        """Items of this forward and the kwargs they came from (to clear)."""
        parts, grids, kinds, used = [], [], [], []
        for kind, pix_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                        ("video", "pixel_values_videos", "video_grid_thw")):
            pix = kwargs.get(pix_key)
            if pix is None:
                continue
            grid = kwargs.get(grid_key)
            if grid is None:
                raise ValueError(f"rank {rank}: {pix_key} given without {grid_key}")
            grid = grid.detach().to("cpu", torch.int64).numpy().reshape(-1, 3)
            rows = int(grid.prod(axis=1).sum())
            if pix.dim() != 2 or pix.shape[0] != rows or pix.shape[1] != self.row_width:
                raise ValueError(f"rank {rank}: {pix_key} has shape {tuple(pix.shape)}, but {grid_key} "
                                 f"describes {rows} rows of width {self.row_width}")
            if ((grid[:, 1] % self.merge) | (grid[:, 2] % self.merge)).any():
                bad = int(np.nonzero((grid[:, 1] % self.merge) | (grid[:, 2] % self.merge))[0][0])
                raise ValueError(f"rank {rank}: {grid_key}[{bad}]={grid[bad].tolist()} is not divisible by "
                                 f"spatial_merge_size={self.merge}")
            parts.append(pix)
            grids.append(grid)
            kinds += [kind] * grid.shape[0]
            used.append(pix_key)
        if not parts:
            return None, used
        grid = np.concatenate(grids)
        # no torch.cat here: rows are gathered straight from each part where needed
        return _LocalItems(pixel_parts=[p.to(self.module.dtype) for p in parts], grids=grid, in_rows=grid.prod(axis=1),
                           out_rows=self.out_rows(grid), kinds=kinds), used

    def out_rows(self, grids: np.ndarray) -> np.ndarray:
        return np.asarray(grids, dtype=np.int64).reshape(-1, 3).prod(axis=1) // (self.merge ** 2)

    def compute(self, pixels: torch.Tensor, grids: np.ndarray, kwargs: dict) -> torch.Tensor:
        """Embedding rows [sum out_rows, out_width] (Qwen3-VL: deepstack features as extra columns)."""
        grid_thw = torch.as_tensor(grids, dtype=torch.int64, device=pixels.device)
        out = self.module(pixels, grid_thw=grid_thw, return_dict=True)
        cols = [out.pooler_output]
        if self.n_deepstack:
            cols += list(out.deepstack_features)
        return torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]

    def encoder_outputs(self, rows: torch.Tensor, items: _LocalItems) -> Dict[str, Any]:
        """`mm_encoder_outputs` in the model's own format from rows in local item order."""
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        result = {}
        start_item, start_row = 0, 0
        for kind in ("image", "video"):
            n = sum(1 for k in items.kinds if k == kind)
            if n == 0:
                continue
            sizes = items.out_rows[start_item:start_item + n].tolist()
            block = rows[start_row:start_row + sum(sizes)]
            start_item, start_row = start_item + n, start_row + sum(sizes)
            pooled = torch.split(block[:, :self.embed_width], sizes)
            if self.n_deepstack:
                from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

                deep = [torch.split(block[:, (k + 1) * self.embed_width:(k + 2) * self.embed_width], sizes)
                        for k in range(self.n_deepstack)]
                result[kind] = BaseModelOutputWithDeepstackFeatures(pooler_output=pooled, deepstack_features=deep)
            else:
                result[kind] = BaseModelOutputWithPooling(pooler_output=pooled)
        return result


class _InternVLTower:
    """InternVL: items are tiles (each runs through the ViT, pixel shuffle and projector on its own)."""

    family = "internvl"

    def __init__(self, inner):
        self.inner = inner
        vc = inner.config.vision_config
        size = vc.image_size if isinstance(vc.image_size, (list, tuple)) else (vc.image_size, vc.image_size)
        patch = vc.patch_size if isinstance(vc.patch_size, (list, tuple)) else (vc.patch_size, vc.patch_size)
        self.tile_shape = (int(vc.num_channels), int(size[0]), int(size[1]))
        self.row_width = int(np.prod(self.tile_shape))
        self.grid = (1, int(size[0]) // int(patch[0]), int(size[1]) // int(patch[1]))
        ratio = float(inner.config.downsample_ratio)
        self.tokens_per_tile = int(round(self.grid[1] * self.grid[2] * ratio * ratio))
        self.out_width = int(inner.config.text_config.hidden_size)

    @property
    def module(self):
        return self.inner.vision_tower

    def local_items(self, kwargs: dict, rank: int) -> Tuple[Optional[_LocalItems], List[str]]:
        pix = kwargs.get("pixel_values")
        if pix is None:
            return None, []
        if pix.dim() != 4 or tuple(pix.shape[1:]) != self.tile_shape:
            raise ValueError(f"rank {rank}: pixel_values has shape {tuple(pix.shape)}, expected (tiles, "
                             f"{', '.join(map(str, self.tile_shape))})")
        n = pix.shape[0]
        grids = np.tile(np.asarray(self.grid, dtype=np.int64), (n, 1))
        return _LocalItems(pixel_parts=[pix.to(self.inner.dtype).reshape(n, self.row_width)], grids=grids,
                           in_rows=np.ones(n, dtype=np.int64), out_rows=self.out_rows(grids),
                           kinds=["image"] * n), ["pixel_values"]

    def out_rows(self, grids: np.ndarray) -> np.ndarray:
        return np.full(np.asarray(grids).reshape(-1, 3).shape[0], self.tokens_per_tile, dtype=np.int64)

    def compute(self, pixels: torch.Tensor, grids: np.ndarray, kwargs: dict) -> torch.Tensor:
        tiles = pixels.reshape((pixels.shape[0],) + self.tile_shape)
        out = self.inner.get_image_features(
            pixel_values=tiles, vision_feature_layer=kwargs.get("vision_feature_layer"),
            vision_feature_select_strategy=kwargs.get("vision_feature_select_strategy"), return_dict=True)
        feats = out.pooler_output
        if feats.shape[1] != self.tokens_per_tile:
            raise ValueError(f"InternVL tile gave {feats.shape[1]} tokens, expected {self.tokens_per_tile} "
                             f"((image_size/patch_size)^2 * downsample_ratio^2)")
        return feats.reshape(-1, feats.shape[-1])

    def encoder_outputs(self, rows: torch.Tensor, items: _LocalItems) -> Dict[str, Any]:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        n = len(items.kinds)
        return {"image": BaseModelOutputWithPooling(pooler_output=rows.reshape(n, self.tokens_per_tile, -1))}


_BASE_MODELS = {"Qwen2VLModel": "qwen2_vl", "Qwen2_5_VLModel": "qwen2_5_vl", "Qwen3VLModel": "qwen3_vl",
                "InternVLModel": "internvl"}


def _find_inner(model) -> Tuple[torch.nn.Module, Any]:
    """The base model that calls the vision tower (takes `mm_encoder_outputs`), and its adapter.

    Matched by class name along the MRO, so the other families' modeling files are not imported.
    """
    for module in model.modules():
        family = next((_BASE_MODELS[c.__name__] for c in type(module).__mro__ if c.__name__ in _BASE_MODELS), None)
        if family is not None:
            tower = _InternVLTower(module) if family == "internvl" else _QwenTower(module, family)
            return module, tower
    raise ValueError(f"balance_vision_encoder: {type(model).__name__} contains no supported vision-language "
                     f"base model ({', '.join(_BASE_MODELS)})")


# --------------------------------------------------------------------------- the wrapper (imperative shell)


class VisionBalancer:
    """Forward hooks on one model that balance its vision tower across the group's ranks.

    Attached as `model._dp_balance_vision` by `balance_vision_encoder`.
    `pop_stats()` returns and clears the per-forward statistics (one dict per
    training forward): applied, reason, items (whole group), items_moved,
    local_items / computed_items (this rank: owned / run here), pixel_bytes_moved /
    embedding_bytes_moved (whole group, forward; the backward moves the
    embedding bytes again), imbalance_before / imbalance_after (slowest rank's
    predicted vision cost over the mean, minus 1: core.steps.step_imbalance), makespan_before / makespan_after.
    `remove()` takes the hooks off. Only the last 1024 forwards are kept.
    """

    def __init__(self, model, config=None, *, group=None, cost_model=None):
        import torch.distributed as dist

        from hf_dp_balance.config import DPBalanceConfig
        from hf_dp_balance.core.cost import CostModel

        self.config = config if config is not None else DPBalanceConfig()
        self.cost_model = cost_model if cost_model is not None else CostModel.default_vision()
        self.inner, self.tower = _find_inner(model)
        if group is None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # An own communicator with the default group's ranks and backend: the
            # backward all_to_all then never interleaves with DDP's gradient
            # all-reduce on the default group (orders could differ across ranks).
            group = dist.new_group(backend=dist.get_backend(),
                                   timeout=datetime.timedelta(seconds=self.config.timeout_s))
        self.group = group
        self._stats: Deque[dict] = collections.deque(maxlen=_MAX_STATS)
        self._pending_tie: Optional[torch.Tensor] = None
        self._handles = [
            self.inner.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            self.inner.language_model.register_forward_pre_hook(self._before_decoder, with_kwargs=True),
            self.inner.register_forward_hook(self._after_forward),
        ]

    # -- public -------------------------------------------------------------------

    def pop_stats(self) -> List[dict]:
        stats = list(self._stats)
        self._stats.clear()
        return stats

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- hooks --------------------------------------------------------------------

    def _active(self) -> bool:
        import torch.distributed as dist

        return (self.inner.training and dist.is_available() and dist.is_initialized()
                and dist.get_world_size(self.group) > 1)

    def _before_forward(self, module, args, kwargs):
        self._pending_tie = None
        if not self._active():
            return None
        if args:  # positional call: name everything so pixel_values can be replaced
            bound = inspect.signature(self.inner.forward).bind(*args, **kwargs)
            extra = bound.arguments.pop("kwargs", {})
            kwargs, args = {**bound.arguments, **extra}, ()
        kwargs = dict(kwargs)
        out = self.balanced_encode(kwargs)
        if out is None:
            return None
        encoder_outputs, used_keys, tie = out
        for key in used_keys:
            kwargs[key] = None
        if encoder_outputs:
            kwargs["mm_encoder_outputs"] = encoder_outputs
        self._pending_tie = tie
        return args, kwargs

    def _before_decoder(self, module, args, kwargs):
        tie, self._pending_tie = self._pending_tie, None
        if tie is None:
            return None
        embeds = kwargs.get("inputs_embeds")
        if embeds is None:
            raise ValueError("balance_vision_encoder: the decoder was called without inputs_embeds; "
                             "cannot tie the vision exchange into the backward")
        kwargs = dict(kwargs)
        kwargs["inputs_embeds"] = _TieGradient.apply(embeds, tie)
        return args, kwargs

    def _after_forward(self, module, args, output):
        if self._pending_tie is not None:  # the decoder never ran: the backward would hang
            self._pending_tie = None
            raise RuntimeError("balance_vision_encoder: the language model was not called in this forward")
        return None

    # -- one balanced forward ---------------------------------------------------------

    def _comm_device(self) -> torch.device:
        import torch.distributed as dist

        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gather_grids(self, grids: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(item_rank, grids) of every item of every rank, rank-major (two all_gathers)."""
        import torch.distributed as dist

        world = dist.get_world_size(self.group)
        dev = self._comm_device()
        count = torch.tensor([grids.shape[0]], dtype=torch.int64, device=dev)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count, group=self.group)
        counts = [int(c.item()) for c in counts]
        width = max(counts)
        if width == 0:
            return np.zeros(0, dtype=np.int64), np.zeros((0, 3), dtype=np.int64)
        padded = torch.zeros((width, 3), dtype=torch.int64, device=dev)
        padded[:grids.shape[0]] = torch.as_tensor(grids, dtype=torch.int64)
        gathered = [torch.zeros_like(padded) for _ in range(world)]
        dist.all_gather(gathered, padded, group=self.group)
        all_grids = np.concatenate([g[:c].cpu().numpy() for g, c in zip(gathered, counts)])
        item_rank = np.repeat(np.arange(world, dtype=np.int64), counts)
        return item_rank, all_grids

    def balanced_encode(self, kwargs: dict):
        """Run steps 1-5 for this rank's forward kwargs.

        Returns None when the plan is skipped (the model then runs its own
        images), else (mm_encoder_outputs for this rank, pixel kwargs to clear,
        tensor to tie into the decoder input or None).
        """
        import torch.distributed as dist

        from hf_dp_balance.runtime.exchange import all_to_all_rows
        from hf_dp_balance.core.planner import plan_balance
        from hf_dp_balance.core.steps import step_imbalance

        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        if kwargs.get("mm_encoder_outputs") is not None:
            items, used = None, []  # precomputed by the caller: take part with no items
        else:
            items, used = self.tower.local_items(kwargs, rank)
        local_grids = items.grids if items is not None else np.zeros((0, 3), dtype=np.int64)
        item_rank, grids = self._gather_grids(local_grids)
        n_local = int(local_grids.shape[0])
        stats = {"applied": False, "items": int(grids.shape[0]), "items_moved": 0,
                 "pixel_bytes_moved": 0, "embedding_bytes_moved": 0,
                 "local_items": n_local, "computed_items": n_local}
        if grids.shape[0] == 0:
            self._stats.append({**stats, "reason": "no images on any rank"})
            return None

        costs = item_costs(grids, self.cost_model)
        try:
            plan = plan_balance(costs, item_rank, world, min_gain=self.config.min_gain,
                                tolerance=self.config.move_tolerance)
        except Exception as exc:  # noqa: BLE001 - same inputs on every rank: every rank skips alike
            logger.warning("vision balancing: planning failed (%s: %s); images stay on their ranks",
                           type(exc).__name__, exc)
            self._stats.append({**stats, "reason": f"planning failed: {type(exc).__name__}: {exc}"})
            return None
        stats.update(reason=plan.reason, makespan_before=float(plan.makespan_before),
                     makespan_after=float(plan.makespan_after),
                     imbalance_before=step_imbalance(plan.loads_before[:, None], "step"),
                     imbalance_after=step_imbalance(plan.loads_after[:, None], "step"))
        if not plan.applied:
            stats["imbalance_after"] = stats["imbalance_before"]
            self._stats.append(stats)
            return None

        dest = np.asarray(plan.dest, dtype=np.int64)
        moved = dest != item_rank
        if not moved.any():  # same plan on every rank: every rank skips the payload exchange alike
            stats["imbalance_after"] = stats["imbalance_before"]
            self._stats.append({**stats, "reason": "plan moves no item"})
            return None
        in_rows = grids.prod(axis=1) if self.tower.family != "internvl" else np.ones(len(grids), dtype=np.int64)
        out_rows = self.tower.out_rows(grids)
        route = route_items(item_rank, dest, in_rows, out_rows, rank, world)
        dtype = self.tower.module.dtype
        elem = torch.empty((), dtype=dtype).element_size()
        stats.update(applied=True, items_moved=int(moved.sum()), computed_items=int(route.computed_items.size),
                     pixel_bytes_moved=int(in_rows[moved].sum()) * self.tower.row_width * elem,
                     embedding_bytes_moved=int(out_rows[moved].sum()) * self.tower.out_width * elem)

        # 3. moved items' pixels to the planned ranks (no gradient: pixels are inputs);
        #    kept items' rows are used in place
        device = self.tower.module.device if hasattr(self.tower.module, "device") else self._comm_device()
        no_rows = torch.zeros((0, self.tower.row_width), dtype=dtype, device=device)
        if items is not None:
            send = _take_rows(items.pixel_parts, rows_in_order(items.in_rows, route.send_order), no_rows)
            kept = _take_rows(items.pixel_parts, rows_in_order(items.in_rows, route.kept_items), no_rows)
        else:
            send, kept = no_rows, no_rows
        received = send.new_empty((sum(route.recv_in_rows), self.tower.row_width))
        dist.all_to_all_single(received, send.contiguous(), output_split_sizes=route.recv_in_rows,
                               input_split_sizes=route.send_in_rows, group=self.group)

        # 4. the real tower on the balanced items: kept first, then received
        differentiable = torch.is_grad_enabled() and any(p.requires_grad for p in self.tower.module.parameters())
        if route.computed_items.size:
            pixels = received if kept.shape[0] == 0 else kept if received.shape[0] == 0 else torch.cat([kept, received])
            computed = self.tower.compute(pixels, grids[route.computed_items], kwargs)
        else:
            computed = torch.zeros((0, self.tower.out_width), dtype=dtype, device=device)
        if computed.shape[1] != self.tower.out_width:
            raise ValueError(f"rank {rank}: vision tower gave width {computed.shape[1]}, expected {self.tower.out_width}")
        if differentiable and not computed.requires_grad:
            # Nothing computed here: a leaf keeps this rank in the backward all_to_all.
            computed = computed.detach().requires_grad_(True)
        kept_out_rows = int(items.out_rows[route.kept_items].sum()) if items is not None else 0
        kept_out, moved_out = computed[:kept_out_rows], computed[kept_out_rows:]

        # 5. moved items' embeddings back to their owners, gradients the reverse way in the backward
        if differentiable:
            back = all_to_all_rows(moved_out, route.send_out_rows, route.recv_out_rows, group=self.group)
        else:
            back = moved_out.new_empty((sum(route.recv_out_rows), self.tower.out_width))
            dist.all_to_all_single(back, moved_out.contiguous(), output_split_sizes=route.recv_out_rows,
                                   input_split_sizes=route.send_out_rows, group=self.group)
        self._stats.append(stats)
        tie = back if differentiable else None
        if items is None:
            return {}, used, tie
        rows = back if kept_out.shape[0] == 0 else kept_out if back.shape[0] == 0 else torch.cat([kept_out, back])
        restore = route.restore_rows
        if not (restore.size == rows.shape[0] and (restore == np.arange(restore.size)).all()):
            rows = rows.index_select(0, torch.from_numpy(restore).to(rows.device))
        return self.tower.encoder_outputs(rows, items), used, tie


def balance_vision_encoder(model, config=None, *, group=None, cost_model=None):
    """Balance the vision tower of `model` across the data-parallel ranks, in place; returns `model`.

    `model`: a Qwen2-VL / Qwen2.5-VL / Qwen3-VL / InternVL model (the
    `...ForConditionalGeneration` or its base model), before DDP / Accelerate
    wrapping. Call it on every rank (it creates a process group when `group` is
    None). `config`: `DPBalanceConfig` (reads `min_gain`, `move_tolerance`,
    `timeout_s`); `cost_model`: the vision `CostModel` (default
    `CostModel.default_vision()`; replace it with `model._dp_balance_vision.cost_model = fitted`).
    Calling it twice replaces the previous wrapper.
    """
    previous = getattr(model, "_dp_balance_vision", None)
    if previous is not None:
        previous.remove()
    balancer = VisionBalancer(model, config, group=group, cost_model=cost_model)
    model._dp_balance_vision = balancer
    return model
