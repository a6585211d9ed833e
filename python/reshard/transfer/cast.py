"""Float casts for the torch executor: a tensor whose destination layout has another float
dtype (a refit of f32 master weights into a bf16 engine, ``Refit(train_dtype=...)``) is
converted by its source rank before it moves, with torch's own ``.to()`` (round to nearest
even, as the core's casts), so the wire carries the destination dtype as it does in the
core. Unlike the core, which converts while it packs, this takes one temporary of the source
shard in the destination dtype (no larger than the shard when the cast narrows)."""

from typing import Dict, List

from .._core import Layout
from .checks import torch_dtype

# the dtypes the core's float casts convert between
FLOATS = frozenset(("f64", "f32", "bf16", "f16"))


def casts(src_layout: Layout, dst_layout: Layout) -> bool:
    """Whether a tensor between these layouts is a float cast this module converts."""
    return src_layout.dtype != dst_layout.dtype and {src_layout.dtype, dst_layout.dtype} <= FLOATS


def cast_at_source(pairs, names: List[str]) -> Dict[str, tuple]:
    """``pairs`` with every float cast turned into a move of one dtype: the source layout in
    the destination's dtype, and the rank's source shard converted into it. A source shard
    that is not of its layout's dtype is left as given, for the shard checks to name."""
    out = dict(pairs)
    for name in names:
        src_local, dst_local, src_layout, dst_layout = pairs[name]
        if not casts(src_layout, dst_layout):
            continue
        held = Layout(
            src_layout.shape,
            dst_layout.dtype,
            src_layout.mesh,
            src_layout.ranks,
            src_layout.placements,
        )
        if src_local is not None and src_local.dtype == torch_dtype(src_layout):
            src_local = src_local.to(torch_dtype(dst_layout))
        out[name] = (src_local, dst_local, held, dst_layout)
    return out
