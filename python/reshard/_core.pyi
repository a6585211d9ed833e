"""Type stubs of the Rust extension: layouts, plans and errors."""

import os
from typing import Any, Iterable, List, Mapping, Optional, Sequence, Tuple, Union, final

__version__: str
DEFAULT_MIN_SPLIT_BYTES: int

class ReshardError(ValueError):
    """Every error of reshard (its subclasses say which kind): the message is the command
    line's, naming the field and the value."""

class ArgumentError(ReshardError):
    """A bad argument, tensor or layout: the message names the argument and the value."""

class AgreementError(ReshardError):
    """The ranks disagree on the job, or another rank refused its part: nothing was moved."""

class ChecksumError(ReshardError):
    """A transfer arrived changed: what landed differs from what its sender sent."""

class PeerLostError(ReshardError):
    """A peer died, closed its link or timed out: the message names the rank."""

class InDoubtError(ReshardError):
    """A rank voted prepared, then lost the coordinator before the decision came."""

class VersionError(ReshardError):
    """A version reused or lower than the last, nothing staged, a stale staging, another asked for."""

class AbortedError(ReshardError):
    """The job decided to abort a staged version: some rank voted not to commit it."""

@final
class Shard:
    """Split tensor dim ``dim`` across one mesh axis with the ``torch.chunk`` rule."""

    dim: int
    def __init__(self, dim: int) -> None: ...
    def is_shard(self, dim: Optional[int] = None) -> bool: ...
    def is_replicate(self) -> bool: ...

@final
class Replicate:
    """Every rank along one mesh axis holds the same data."""

    def __init__(self) -> None: ...
    def is_shard(self, dim: Optional[int] = None) -> bool: ...
    def is_replicate(self) -> bool: ...

#: ``"S(0)"``, ``"Shard(0)"``, ``"R"``, ``Shard(0)``, ``Replicate()``, or torch's own
#: ``torch.distributed.tensor.Shard`` / ``Replicate``.
PlacementLike = Union[str, Shard, Replicate, Any]

#: ``(offset, extent)`` in global coordinates.
Region = Tuple[Tuple[int, ...], Tuple[int, ...]]

@final
class Layout:
    """A tensor laid out over a mesh of ranks: which box every rank holds."""

    def __init__(
        self,
        shape: Iterable[int],
        dtype: Union[str, Any],
        mesh: Union[int, Iterable[int]],
        ranks: Optional[Iterable[int]],
        placements: Union[str, Iterable[PlacementLike]],
    ) -> None: ...
    @staticmethod
    def from_spec(spec: str, shape: Iterable[int], dtype: Union[str, Any], first_rank: int = 0) -> Layout: ...
    @staticmethod
    def from_dtensor(dt: Any) -> Layout: ...
    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def elem_bytes(self) -> int: ...
    @property
    def ndim(self) -> int: ...
    @property
    def mesh(self) -> Tuple[int, ...]: ...
    @property
    def ranks(self) -> Tuple[int, ...]: ...
    @property
    def placements(self) -> Tuple[Union[Shard, Replicate], ...]: ...
    @property
    def spec(self) -> str: ...
    def local_region(self, rank: int) -> Optional[Region]: ...
    def local_shape(self, rank: int) -> Optional[Tuple[int, ...]]: ...
    @property
    def replicas(self) -> list[list[int]]:
        """For each replica of the whole tensor, the ranks that together hold one copy."""
    def rolling_groups(self, rolling: int) -> list[list[int]]:
        """As a destination, a rolling commit's ``rolling`` groups, each whole replicas.

        Raises ``ReshardError`` naming the replica that ``rolling`` would cut."""
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Transfer:
    """One box moved from ``src`` to ``dst`` (``src == dst``: a local copy)."""

    @property
    def src(self) -> int: ...
    @property
    def dst(self) -> int: ...
    @property
    def offset(self) -> Tuple[int, ...]: ...
    @property
    def extent(self) -> Tuple[int, ...]: ...
    @property
    def bytes(self) -> int: ...
    @property
    def is_local(self) -> bool: ...
    def to_dict(self) -> dict[str, Any]: ...
    def __lt__(self, other: Transfer) -> bool: ...

@final
class RankPlan:
    """One rank's sends, receives and local copies, in schedule order."""

    @property
    def rank(self) -> int: ...
    @property
    def sends(self) -> list[Transfer]: ...
    @property
    def recvs(self) -> list[Transfer]: ...
    @property
    def locals(self) -> list[Transfer]: ...
    @property
    def peers(self) -> list[int]: ...

@final
class Plan:
    """Every transfer between two layouts, computed without communication."""

    @property
    def src(self) -> Layout: ...
    @property
    def dst(self) -> Layout: ...
    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def elem_bytes(self) -> int: ...
    @property
    def transfers(self) -> list[Transfer]: ...
    @property
    def totals(self) -> dict[str, int]: ...
    @property
    def ranks(self) -> list[int]: ...
    def to_json(self) -> str: ...
    def for_rank(self, rank: int) -> RankPlan: ...
    def __len__(self) -> int: ...

@final
class Refit:
    """A whole model's parameters with their training and inference layouts."""

    def __init__(
        self,
        model: Union[str, "os.PathLike[str]"],
        train: str,
        infer: str,
        colocated: bool = False,
        overrides: Sequence[str] = (),
        min_split_bytes: Optional[int] = None,
        infer_quant: Optional[str] = None,
        train_dtype: Optional[Union[str, Any]] = None,
        infer_dtype: Optional[Union[str, Any]] = None,
    ) -> None: ...
    @property
    def model(self) -> str: ...
    @property
    def names(self) -> list[str]: ...
    @property
    def train_ranks(self) -> int: ...
    @property
    def infer_ranks(self) -> int: ...
    @property
    def infer_base(self) -> int: ...
    @property
    def world(self) -> int: ...
    @property
    def replicas(self) -> list[list[int]]:
        """For each inference replica (an engine), the ranks that together serve one copy."""
    def rolling_groups(self, rolling: int) -> list[list[int]]:
        """A rolling commit's ``rolling`` groups, each whole inference replicas.

        Raises ``ReshardError`` naming the replica that ``rolling`` would cut."""
    def layouts(self, name: str) -> Tuple[Layout, Layout]: ...
    def rank_names(self, rank: int) -> list[str]: ...
    def fused(self, rank: int, side: str = "infer") -> dict[str, list[Tuple[str, int, int, int]]]: ...
    def check(self, tensors: Mapping[str, Any], side: str = "train", rank: Optional[int] = None) -> None: ...
    def totals(self) -> dict[str, Any]: ...
    def __len__(self) -> int: ...

_Piece = Tuple[int, Sequence[int], Sequence[int], int]

@final
class Packing:
    """The copies of one bucket of a reshard on one rank (CPU tensors): every message's
    regions ``(slot, offset, extent, at)`` and the local copies, over tensor slots."""

    def __init__(
        self,
        slots: Sequence[Optional[Tuple[Sequence[int], int]]],
        sends: Sequence[Tuple[int, Sequence[_Piece]]],
        recvs: Sequence[Tuple[int, Sequence[_Piece]]],
        locals: Sequence[Tuple[int, Sequence[int], int, Sequence[int], Sequence[int]]],
    ) -> None: ...
    def pack(self, tensors: Sequence[Any], buffers: Sequence[Any]) -> None: ...
    def unpack(self, buffers: Sequence[Any], tensors: Sequence[Any]) -> None: ...
    def copy_locals(self, tensors: Sequence[Any]) -> None: ...

#: ``(bytes of the encoding, blocks per tag (unchanged, bitmask, offsets, dense), changed
#: elements when encoding / written elements when applying)``.
_DeltaStats = Tuple[int, List[int], int]

def delta_encode(
    new: Any,
    base: Any,
    out: Any,
    at: int = 0,
    *,
    update_base: bool = True,
    smaller_only: bool = False,
    block_elems: int = 4096,
) -> _DeltaStats:
    """Encodes the CPU tensor ``new`` (any view) against ``base`` (as many elements of its
    size) in the core's delta format into the contiguous 1-D uint8 CPU tensor ``out`` from
    byte ``at``; ``base`` takes the new values with ``update_base``; with ``smaller_only`` an
    encoding not smaller than the region is not written. GIL released."""

def delta_apply(encoded: Any, dst: Any, at: int = 0, nbytes: Optional[int] = None) -> _DeltaStats:
    """Applies the encoding at ``encoded[at:at + nbytes]`` onto the CPU tensor ``dst`` (any
    view, holding the base), in place; checked whole before anything is written."""

def delta_written(
    encoded: Any,
    shape: Sequence[int],
    strides: Sequence[int],
    elem: int,
    at: int = 0,
    nbytes: Optional[int] = None,
) -> Tuple[bytearray, bytearray, _DeltaStats]:
    """What the encoding at ``encoded[at:at + nbytes]`` writes into a region of ``shape``,
    element ``strides`` and ``elem``-byte elements: the elements' offsets from the region's
    first one (int64, little-endian) and their values, for a tensor on another device."""

def plan(src: Layout, dst: Layout, min_split_bytes: Optional[int] = None) -> Plan: ...
def rank_plan(src: Layout, dst: Layout, rank: int, min_split_bytes: Optional[int] = None) -> RankPlan: ...
def rank_program(
    layouts: Sequence[Tuple[Layout, Layout]], rank: int, min_split_bytes: Optional[int] = None
) -> Tuple[
    List[Tuple[int, int, List[Tuple[int, List[int], List[int], List[int], int, int]]]],
    List[Tuple[int, int, List[Tuple[int, List[int], List[int], List[int], int, int]]]],
    List[Tuple[int, List[int], List[int], List[int]]],
]:
    """This rank's program for every (src, dst) pair at once, as the runtime lowers each plan:
    (sends, recvs, locals); a message is (peer, bytes, regions), a region (tensor, offset in
    the local shard, extent, global offset, byte in the message, bytes), a local copy
    (tensor, source offset, destination offset, extent)."""

class QuantAmax:
    """A source rank's amax of one tensor, before the peers' partial amax."""

class QuantScales:
    """A source rank's scales of one tensor."""

class QuantPacking:
    """One rank's part of a reshard into fp8 with scales (CPU tensors): the partial amax
    exchange, the quantizing pack and the unpack of values and scales."""

    def __init__(
        self, src: Layout, dst: Layout, rank: int, quant: str, scale_dtype: Optional[str] = None
    ) -> None: ...
    @property
    def amax_messages(self) -> List[Tuple[int, int]]: ...
    @property
    def sends(self) -> List[Tuple[int, int]]: ...
    @property
    def recvs(self) -> List[Tuple[int, int]]: ...
    @property
    def local_bytes(self) -> int: ...
    @property
    def scale_shape(self) -> Optional[List[int]]: ...
    @property
    def scale_dtype(self) -> str: ...
    @property
    def block(self) -> List[int]: ...
    @property
    def scheme(self) -> str: ...
    @property
    def fp8_limits(self) -> Tuple[float, int]: ...
    @property
    def amax_blocks(self) -> List[Tuple[int, List[int], List[int]]]: ...
    @property
    def scale_offset(self) -> Optional[List[int]]: ...
    def messages(
        self, which: str
    ) -> List[
        Tuple[
            int,
            int,
            List[Tuple[int, int, int, List[int], List[int]]],
            List[Tuple[int, List[int], List[int]]],
        ]
    ]: ...
    def amax(self, src: Any) -> Tuple[Optional[QuantAmax], List[bytes]]: ...
    def merge(self, amax: Optional[QuantAmax], payloads: Sequence[bytes]) -> Optional[QuantScales]: ...
    def pack(self, scales: QuantScales, src: Any, buffers: Sequence[Any], local: Any = None) -> None: ...
    def unpack(self, buffers: Sequence[Any], dst: Any, scale: Any, local: Any = None) -> None: ...

def quant_scale_shape(dst: Layout, rank: int, quant: str) -> Optional[List[int]]: ...
def quant_scale_dtype(quant: str, scale_dtype: Optional[str] = None) -> str: ...
def quantized_scale_layouts(
    src: Layout, dst: Layout, quant: str, scale_dtype: Optional[str] = None
) -> Tuple[Layout, Layout]: ...
