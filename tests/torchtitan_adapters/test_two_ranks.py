"""europa-offload and europa-overlap inside torchtitan 0.3.0's own Trainer (the
``deepseek_v3`` debugmodel, FSDP2 over 2 gloo ranks, full activation checkpointing):
each adapter's losses are bit-identical to torchtitan's alone, offload moves bytes, and
an adapter that does not fit the job is refused in one line before any step. One
spawned group runs every Trainer, one after the other."""

from __future__ import annotations

import pytest

from tests.conftest import run_ranks

STEPS = 10


def _refusal(build) -> str:
    try:
        build()
    except Exception as err:  # the adapter's own error, as torchtitan's build lets it out
        return f"{type(err).__name__}: {err}"
    return "built"


def _trainers(rank: int, world: int, folder: str) -> dict:
    from europa.offload import OffloadPolicy
    from europa.offload.torchtitan import offload_record, with_offload
    from europa.overlap.torchtitan import with_overlap
    from tests.torchtitan_cpu import debug_job, train

    def job(**args):
        return debug_job(rank, world, STEPS, folder, full_ac=True, **args)

    plain, _ = train(job())
    offloaded_job = job()
    offloaded_job.model_spec = with_offload(offloaded_job.model_spec, OffloadPolicy(min_bytes=1))
    offloaded, parts = train(offloaded_job)
    overlapped_job = job()
    overlapped_job.model_spec = with_overlap(overlapped_job.model_spec, depth=2)
    overlapped, overlapped_parts = train(overlapped_job)
    prefetching = [
        len(block._get_fsdp_state()._states_to_forward_prefetch)
        for block in overlapped_parts[0].layers.values()
    ]

    compiled = job()
    compiled.compile.enable = True
    compiled.model_spec = with_offload(compiled.model_spec)
    chunked = job()
    chunked.model_spec = with_overlap(chunked.model_spec, expert_chunks=2)
    return {
        "plain": plain,
        "offloaded": offloaded,
        "offloaded_bytes": [s.bytes_offloaded for s in offload_record(parts[0]).steps],
        "overlapped": overlapped,
        "prefetching": prefetching,
        "compile_refused": _refusal(compiled.build),
        "chunks_refused": _refusal(chunked.build),
    }


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("torchtitan")
    return run_ranks(_trainers, 2, str(folder), timeout=300)


@pytest.mark.distributed
def test_offload_in_torchtitan_leaves_the_losses_bit_identical_and_moves_bytes(ranks):
    for rank in ranks:
        assert len(rank["plain"]) == STEPS
        assert rank["offloaded"] == rank["plain"]
        assert len(rank["offloaded_bytes"]) == STEPS
        assert all(moved > 0 for moved in rank["offloaded_bytes"])


@pytest.mark.distributed
def test_overlap_in_torchtitan_leaves_the_losses_bit_identical(ranks):
    for rank in ranks:
        assert rank["overlapped"] == rank["plain"]
        assert rank["prefetching"][:-2] == [2] * (len(rank["prefetching"]) - 2)  # depth 2
        assert rank["prefetching"][-2:] == [1, 0]


@pytest.mark.distributed
def test_an_adapter_that_does_not_fit_the_job_is_refused_in_one_line(ranks):
    for rank in ranks:
        assert rank["compile_refused"] == (
            "OffloadError: compile.enable = true: expected false with europa-offload, whose "
            "saved-tensor hooks torch.compile does not trace through"
        )
        assert rank["chunks_refused"].startswith(
            "OverlapError: expert_chunks = 2: no MoE layer offers the chunked exchange "
            "(parallelism.expert_parallel_degree = 1"
        )
