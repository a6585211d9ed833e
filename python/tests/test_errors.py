"""Every error of reshard is a ReshardError of one kind, raised where it happens with its
message unchanged: a bad argument (ArgumentError), ranks that disagree or another rank's
refusal (AgreementError), a transfer that arrived changed (ChecksumError), a lost peer
(PeerLostError), a rank in doubt (InDoubtError), a version out of order (VersionError), a
staged version the job aborted (AbortedError). Checked with real calls: the core's layouts and
refits, the runtime's control plane on threads, and reshards over gloo processes, where every
call, the first or a later one, refuses on every rank before any byte moves."""

import re
import secrets
import threading
from pathlib import Path

import pytest

import reshard

try:
    import torch

    import reshard.torch as rt
    from reshard.transfer import bucket
except ImportError:  # the tests that need them skip
    torch = rt = bucket = None
from reshard import (
    AbortedError,
    AgreementError,
    ArgumentError,
    ChecksumError,
    InDoubtError,
    PeerLostError,
    ReshardError,
    VersionError,
)

KINDS = [
    ArgumentError,
    AgreementError,
    ChecksumError,
    PeerLostError,
    InDoubtError,
    VersionError,
    AbortedError,
]

# generous: processes that start and import torch on a loaded machine join well within it
TIMEOUT = 120


def test_every_kind_is_a_documented_reshard_error_exported_from_reshard():
    stubs = (Path(reshard.__file__).parent / "_core.pyi").read_text()
    for kind in KINDS:
        assert issubclass(kind, ReshardError) and issubclass(kind, ValueError), kind
        assert kind.__module__ == "reshard" and kind.__name__ in reshard.__all__
        assert getattr(reshard._core, kind.__name__) is kind
        assert kind.__doc__ and "\n" not in kind.__doc__.strip(), kind
        assert re.search(rf"^class {kind.__name__}\(ReshardError\):\n    \"\"\".+\"\"\"$", stubs, re.M), kind
    assert len(set(KINDS)) == len(KINDS)
    assert not any(issubclass(a, b) for a in KINDS for b in KINDS if a is not b)


@pytest.mark.parametrize(
    "call, message",
    [
        (
            lambda: reshard.Layout((4,), "b17", 2, None, ["S(0)"]),
            "dtype: unknown dtype `b17` (expected one of bool, u8, i8, fp8e4m3, fp8e5m2, bf16, f16, "
            "i16, u16, f32, i32, u32, f64, i64, u64)",
        ),
        (
            lambda: reshard.Layout((4,), "f32", 2, [0, 0], ["S(0)"]),
            "rank 0 appears more than once in ranks",
        ),
        (
            lambda: reshard.plan(
                reshard.Layout((4, 4), "f32", 2, None, ["S(0)"]),
                reshard.Layout((4, 8), "f32", 2, [2, 3], ["S(0)"]),
            ),
            "shape: the sides disagree: src has shape 4x4, dst has shape 4x8",
        ),
        (
            lambda: reshard.Refit("qwen3-0.6b", "tp=3", "tp=2"),
            "train: `tp=3`: does not divide the model's 16 attention heads (write tp=2 or tp=4)",
        ),
        (
            lambda: reshard.Refit("qwen3-0.6b", "tp=2", "tp=2").check({"bogus": None}),
            "tensors: bogus is neither a parameter of qwen3-0.6b nor a fused buffer of its train "
            "side (see Refit.names and Refit.fused): the config may not describe this model",
        ),
    ],
)
def test_the_cores_refusals_of_bad_input_are_argument_errors(call, message):
    with pytest.raises(ArgumentError) as e:
        call()
    assert isinstance(e.value, ReshardError)
    assert str(e.value) == message


# --- the runtime's control plane, its ranks on threads of this process ---


def _controls(world: int, timeout: float = 30.0):
    listener = reshard._core.ControlListener("127.0.0.1")
    token = secrets.token_hex(16)
    out = [None] * world

    def join(r):
        out[r] = reshard._core.Control(
            r, world, "127.0.0.1", listener.port, token, timeout, listener if r == 0 else None
        )

    _threads([lambda r=r: join(r) for r in range(world)])
    assert all(c is not None for c in out)
    return out


def _threads(calls):
    """Runs every call on a thread of its own; each one's result, or the error it raised."""
    results = [None] * len(calls)

    def run(i):
        try:
            results[i] = calls[i]()
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_the_runtime_names_a_disagreement_or_a_refusal_with_an_agreement_error():
    ctl = _controls(2)
    shapes = ["4", "8"]
    raised = _threads([lambda r=r: ctl[r].agree("job", [("shape", shapes[r])]) for r in range(2)])
    for e in raised:
        assert isinstance(e, AgreementError), e
        assert str(e) == (
            "the ranks disagree on the job, so nothing was moved: rank 1 runs shape 8; rank 0 runs shape 4"
        )
    why = [None, "w: dst_local: the wrong shape"]
    raised = _threads([lambda r=r: ctl[r].agree("job", [("shape", "4")], why[r]) for r in range(2)])
    for e in raised:
        assert isinstance(e, AgreementError), e
        assert str(e) == (
            "rank 1 cannot run its part of the job, so nothing was moved: w: dst_local: the wrong shape"
        )


def test_a_peer_that_closed_its_link_is_a_lost_peer():
    ctl = _controls(2)

    def leave():
        ctl[0] = None  # rank 0's process is gone: its links close

    raised = _threads([leave, lambda c=ctl[1]: c.barrier()])
    assert raised[0] is None
    assert isinstance(raised[1], PeerLostError), raised[1]
    assert str(raised[1]) == "rank 1: peer rank 0 is gone: connection closed during the barrier"


def test_a_rank_that_voted_prepared_and_lost_the_coordinator_is_in_doubt():
    ctl = _controls(3)
    voted = threading.Barrier(3)

    def vote(r):
        c = ctl[r]
        voted.wait()
        return c.decide(None)

    def leave():
        voted.wait()
        # the others' votes are on their way before rank 0 goes
        threading.Event().wait(1.0)
        ctl[0] = None

    raised = _threads([leave, lambda: vote(1), lambda: vote(2)])
    for r in (1, 2):
        e = raised[r]
        assert isinstance(e, InDoubtError), e
        assert str(e).startswith(
            f"rank {r}: in doubt: it voted prepared, then lost rank 0 before the decision came ("
        ), str(e)


# --- reshards over gloo processes ---

SHAPE = (8, 12)


def run_ranks(fn, world):
    pytest.importorskip("torch")
    from conftest import run_ranks as run

    run(fn, world)


def _full():
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) + 1


def _object_collectives(counts):
    """Counts this process's ``all_gather_object`` calls in ``counts[0]``."""
    real = torch.distributed.all_gather_object

    def counted(*args, **kwargs):
        counts[0] += 1
        return real(*args, **kwargs)

    torch.distributed.all_gather_object = counted
    return real


def later_refusal(rank, world):
    # every rank is a source (rows) and a destination (columns)
    src = reshard.Layout(SHAPE, "f32", 4, range(4), ["S(0)"])
    dst = reshard.Layout(SHAPE, "f32", 4, range(4), ["S(1)"])
    full = _full()
    s = rt.local_tensor(src, rank, full).clone()
    d = torch.zeros(dst.local_shape(rank))
    want = rt.local_tensor(dst, rank, full)
    rt.reshard_(s, d, src, dst)  # the first call: the group agrees on the job
    assert torch.equal(d, want)

    counts = [0]
    real = _object_collectives(counts)
    try:
        d.zero_()
        rt.reshard_(s, d, src, dst)  # a later call exchanges a few integers, no objects
        assert torch.equal(d, want)
        assert counts[0] == 0, counts

        # a later call where rank 2 gives a destination of the wrong shape: every rank
        # raises before any byte moves, rank 2 its own error, the others naming rank 2
        d.zero_()
        mine = torch.zeros(3, 3) if rank == 2 else d
        with pytest.raises(ReshardError) as e:
            rt.reshard_(s, mine, src, dst)
        own = (
            "dst_local: rank 2 holds a shard of shape (8, 3) (f32) in mesh=4 ranks=0..4 "
            "place=S(1), but the tensor given has shape (3, 3) and dtype float32"
        )
        if rank == 2:
            assert type(e.value) is ArgumentError and str(e.value) == own, repr(e.value)
        else:
            assert type(e.value) is AgreementError, repr(e.value)
            assert str(e.value) == f"nothing was moved: rank 2: {own}"
        assert not d.any() and not mine.any(), "a destination was written"
    finally:
        torch.distributed.all_gather_object = real

    # a later call on other layouts by rank 1 alone: the ranks disagree, all say where
    other = reshard.Layout(SHAPE, "f32", 4, [1, 0, 2, 3], ["S(1)"]) if rank == 1 else dst
    with pytest.raises(AgreementError) as e:
        rt.reshard_(s, d, src, other)
    assert str(e.value) == (
        "the ranks disagree on the job, so nothing was moved: rank 1 runs dst_layout mesh=4 "
        "ranks=1,0,2..4 place=S(1) shape=8,12 dtype=f32; rank 0 runs dst_layout mesh=4 "
        "ranks=0..4 place=S(1) shape=8,12 dtype=f32"
    ), str(e.value)
    assert not d.any()

    # and the group goes on: the next good call moves the data
    rt.reshard_(s, d, src, dst)
    assert torch.equal(d, want)


def test_a_bad_tensor_on_a_later_call_is_refused_on_every_rank():
    run_ranks(later_refusal, 4)


def bad_argument_on_a_later_call(rank, world):
    src = reshard.Layout(SHAPE, "f32", 2, [0, 1], ["S(0)"])
    dst = reshard.Layout(SHAPE, "f32", 2, [2, 3], ["S(1)"])
    s = rt.local_tensor(src, rank, _full())
    d = None if dst.local_shape(rank) is None else torch.zeros(dst.local_shape(rank))
    rt.reshard_many_({"w": (s, d, src, dst)})
    if d is not None:
        d.zero_()
    # rank 0 alone gives a bucket size that is no size: refused on every rank
    with pytest.raises(ReshardError) as e:
        rt.reshard_many_({"w": (s, d, src, dst)}, bucket_bytes=-1 if rank == 0 else 1 << 20)
    own = "bucket_bytes: -1 is invalid: it must be a positive number"
    if rank == 0:
        assert type(e.value) is ArgumentError and str(e.value) == own
    else:
        assert type(e.value) is AgreementError and str(e.value) == f"nothing was moved: rank 0: {own}"
    assert d is None or not d.any()


def test_a_bad_argument_on_a_later_call_is_refused_on_every_rank():
    run_ranks(bad_argument_on_a_later_call, 4)


def non_finite_source(rank, world):
    shape = (16, 32)
    src = reshard.Layout(shape, "bf16", 2, [0, 1], ["S(0)"])
    dst = reshard.Layout(shape, "fp8e4m3", 2, [2, 3], ["S(1)"])
    full = torch.ones(shape, dtype=torch.bfloat16)
    s = rt.local_tensor(src, rank, full)
    s = None if s is None else s.clone()
    d = dst.local_shape(rank)
    d = None if d is None else torch.zeros(d, dtype=torch.float8_e4m3fn)
    scale = rt.scale_tensor(dst, rank, "block:8x16")

    def go():
        rt.reshard_(s, d, src, dst, quant="block:8x16", scale=scale)

    go()
    if d is not None:
        d.zero_()
        scale.zero_()
    if rank == 1:
        s[2, 5] = float("nan")
    with pytest.raises(ReshardError) as e:
        go()
    own = "src_local: block [1, 0] holds a non-finite value (NaN) at element [10, 5], which fp8 cannot carry"
    if rank == 1:
        assert type(e.value) is ArgumentError and str(e.value) == own, repr(e.value)
    else:
        assert type(e.value) is AgreementError, repr(e.value)
        assert str(e.value) == f"nothing was moved: rank 1: {own}"
    if d is not None:
        assert not d.view(torch.uint8).any() and not scale.any()


def test_a_non_finite_source_is_a_bad_argument_on_its_rank_and_refused_on_the_others():
    run_ranks(non_finite_source, 4)


def changed_transfer(rank, world):
    src = reshard.Layout(SHAPE, "f32", 1, [0], ["R"])
    dst = reshard.Layout(SHAPE, "f32", 1, [1], ["R"])
    s = _full() if rank == 0 else None
    d = torch.zeros(SHAPE) if rank == 1 else None
    seal = bucket.Message.seal

    def corrupt(message, buffer):
        seal(message, buffer)
        buffer[5] ^= 0x10

    if rank == 0:
        bucket.Message.seal = corrupt
    try:
        if rank == 1:
            with pytest.raises(ChecksumError) as e:
                rt.reshard_(s, d, src, dst, checksum=True)
            assert str(e.value).startswith(
                "rank 1: checksum mismatch in the transfer from rank 0 to rank 1 at offset [0, 0] "
                "extent 8x12: sent with crc32c 0x"
            ), str(e.value)
            assert not d.any(), "a region was unpacked"
        else:
            rt.reshard_(s, d, src, dst, checksum=True)
    finally:
        bucket.Message.seal = seal


def test_a_transfer_that_arrived_changed_is_a_checksum_error():
    run_ranks(changed_transfer, 2)


def not_the_base(rank, world):
    src = reshard.Layout(SHAPE, "f32", 1, [0], ["R"])
    dst = reshard.Layout(SHAPE, "f32", 1, [1], ["R"])
    full = _full()
    d = torch.zeros(SHAPE) if rank == 1 else None
    session = rt.DeltaSession(checksum=True)

    def refit():
        return session.refit({"w": (full if rank == 0 else None, d, src, dst)})

    refit()
    full = full.clone()
    full[0, 0] += 1
    if rank == 1:
        d[3, 3] += 1  # changed outside the refit: the shard no longer holds the base
        with pytest.raises(ChecksumError, match="checksum mismatch after applying"):
            refit()
    else:
        refit()


def test_a_delta_onto_a_shard_that_was_not_its_base_is_a_checksum_error():
    run_ranks(not_the_base, 2)


def versions(rank, world):
    src = reshard.Layout(SHAPE, "f32", 1, [0], ["R"])
    dst = reshard.Layout(SHAPE, "f32", 1, [1], ["R"])
    full = _full()
    d = torch.zeros(SHAPE) if rank == 1 else None
    pairs = {"w": (full if rank == 0 else None, d, src, dst)}
    session = rt.DeltaSession()
    session.refit(pairs, 3)
    with pytest.raises(VersionError) as e:
        session.refit(pairs, 2)
    assert str(e.value).startswith("version: 2 is not above version 3"), str(e.value)
    with pytest.raises(VersionError, match="^commit: nothing is staged: prepare a version first$"):
        session.commit()

    # a refit between prepare and commit leaves the staging stale: the job aborts it
    session.prepare(pairs, 4)
    session.refit(pairs, 5)
    stale = "version 4 was staged onto shards serving version 3, but they now serve version 5"
    with pytest.raises(AbortedError, match=stale):
        session.commit()
    assert session.staged is None and session.serving == 5


def test_versions_out_of_order_and_an_aborted_staging():
    run_ranks(versions, 2)


def not_a_dtensor(rank, world):
    src = {"w": torch.zeros(2)} if rank == 1 else {}
    with pytest.raises(ReshardError) as e:
        rt.reshard_state_dict_(src, {})
    own = "w: src holds a Tensor, not a DTensor: give its layout in reshard_many_'s pairs"
    if rank == 1:
        assert type(e.value) is ArgumentError and str(e.value) == own
    else:
        assert type(e.value) is AgreementError and str(e.value) == f"nothing was moved: rank 1: {own}"


def test_a_state_dict_entry_that_is_no_dtensor_is_refused_on_every_rank():
    run_ranks(not_a_dtensor, 2)
