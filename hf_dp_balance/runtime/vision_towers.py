"""Per-family adapters of the vision tower for `VisionBalancer`: Qwen2-VL / Qwen2.5-VL / Qwen3-VL, InternVL.

An adapter reads a forward's vision items (pixel rows, grids (t, h, w), embedding rows per item), runs
the real tower on any set of items (the result of an item does not depend on the others in the call) and
hands the rows back in the model's own `mm_encoder_outputs` format.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch


@dataclass
class LocalItems:
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

    def local_items(self, kwargs: dict, rank: int) -> Tuple[Optional[LocalItems], List[str]]:
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
            for key, value in ((pix_key, pix), (grid_key, grid)):
                if not isinstance(value, torch.Tensor):
                    raise ValueError(f"rank {rank}: {key} is a {type(value).__name__}, not a tensor")
            if grid.numel() % 3:
                raise ValueError(f"rank {rank}: {grid_key} has shape {tuple(grid.shape)}, not [items, 3]")
            grid = grid.detach().to("cpu", torch.int64).numpy().reshape(-1, 3)
            if (grid < 1).any():
                bad = int(np.nonzero((grid < 1).any(axis=1))[0][0])
                raise ValueError(f"rank {rank}: {grid_key}[{bad}]={grid[bad].tolist()} has a dimension below 1")
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
        return LocalItems(pixel_parts=[p.to(self.module.dtype) for p in parts], grids=grid, in_rows=grid.prod(axis=1),
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

    def encoder_outputs(self, rows: torch.Tensor, items: LocalItems) -> Dict[str, Any]:
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

    def local_items(self, kwargs: dict, rank: int) -> Tuple[Optional[LocalItems], List[str]]:
        pix = kwargs.get("pixel_values")
        if pix is None:
            return None, []
        if not isinstance(pix, torch.Tensor):
            raise ValueError(f"rank {rank}: pixel_values is a {type(pix).__name__}, not a tensor")
        if pix.dim() != 4 or tuple(pix.shape[1:]) != self.tile_shape:
            raise ValueError(f"rank {rank}: pixel_values has shape {tuple(pix.shape)}, expected (tiles, "
                             f"{', '.join(map(str, self.tile_shape))})")
        n = pix.shape[0]
        grids = np.tile(np.asarray(self.grid, dtype=np.int64), (n, 1))
        return LocalItems(pixel_parts=[pix.to(self.inner.dtype).reshape(n, self.row_width)], grids=grids,
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

    def encoder_outputs(self, rows: torch.Tensor, items: LocalItems) -> Dict[str, Any]:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        n = len(items.kinds)
        return {"image": BaseModelOutputWithPooling(pooler_output=rows.reshape(n, self.tokens_per_tile, -1))}


_BASE_MODELS = {"Qwen2VLModel": "qwen2_vl", "Qwen2_5_VLModel": "qwen2_5_vl", "Qwen3VLModel": "qwen3_vl",
                "InternVLModel": "internvl"}


def find_inner(model) -> Tuple[torch.nn.Module, Any]:
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


__all__ = ["LocalItems", "find_inner"]
