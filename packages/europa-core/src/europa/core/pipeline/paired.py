"""DualPipeV's paired chunks side by side: one micro-batch's forward on this thread, another
micro-batch's backward on a second thread, so that while one waits for its expert exchange
the other computes.

Design note. torch's runtime runs an ``OVERLAP_F_B`` action's two parts one after the other
unless a function is registered for it (``register_custom_function``); this is that
function. The backward runs in a thread of its own inside the backward lane
(``europa.spec.lanes``): its collectives go over twin process groups, so the two threads
never race on one group. A wait on gloo or NCCL releases the GIL, so one part computes
while the other's exchange travels. The two parts belong to different stages (a V-shaped
schedule pairs a rank's two stages), so their modules, gather units and saved tensors are
disjoint. What the schedule itself keeps (received inputs, the backward count, the losses)
is read and written on this thread only: before the backward thread starts or after it ends.
Gradients accumulate into the same parameters in the same order as run one after the
other: each parameter belongs to one stage.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

from torch.distributed.pipelining.schedules import _wait_batch_p2p

from europa.spec.lanes import backward_lane


def paired_chunks(action, ctx, span: Callable[[], AbstractContextManager] = nullcontext) -> None:
    """Run ``action`` (an ``OVERLAP_F_B``: a forward, then a full backward) with its two
    parts side by side; ``ctx``: torch's ``_PipelineContext``; ``span``: entered around
    the two parts' computation (their inputs received)."""
    schedule = ctx.schedule_ref
    stages = {stage.stage_index: stage for stage in schedule._stages}
    forward, backward = action.sub_actions
    f_stage, b_stage = stages[forward.stage_index], stages[backward.stage_index]
    f_micro, b_micro = forward.microbatch_index, backward.microbatch_index
    if not f_stage.is_first and f_stage.stage_index - 1 not in stages:
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((f_stage.stage_index, f_micro)))
    if not b_stage.is_last and b_stage.stage_index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((b_stage.stage_index, b_micro)))
    loss = schedule._maybe_get_loss(b_stage, b_micro)
    schedule.backward_counter[b_stage.stage_index] += 1
    last = schedule.backward_counter[b_stage.stage_index] == schedule._n_microbatches
    failed: list[BaseException] = []

    def run_backward() -> None:
        try:
            with backward_lane():
                b_stage.backward_one_chunk(b_micro, loss=loss, full_backward=True,
                                           last_backward=last)  # fmt: skip
        except BaseException as error:  # raised again on this thread
            failed.append(error)

    thread = threading.Thread(target=run_backward, name=f"backward {backward}", daemon=True)
    with span():
        thread.start()
        try:
            output = f_stage.forward_one_chunk(f_micro, ctx.arg_mbs[f_micro],
                                               ctx.kwarg_mbs[f_micro])  # fmt: skip
            schedule._maybe_compute_loss(f_stage, output, ctx.target_mbs, f_micro)
        finally:
            thread.join()  # a peer that never answers ends at the collective timeout
    if failed:
        raise failed[0]
    if f_stage.stage_index + 1 in stages:  # a V's turn: the next stage is this rank's
        stages[f_stage.stage_index + 1].set_local_fwd_input(output, f_micro)
    if b_stage.stage_index - 1 in stages:
        stages[b_stage.stage_index - 1].set_local_bwd_input(
            b_stage.get_local_bwd_output(b_micro), b_micro
        )
