"""What a pipeline rank's stages did in a step, counted where torch's stages do it: the
bytes they sent to other ranks (each send op a stage hands the schedule) and the time
they computed (each forward, backward and weight-gradient chunk, and the loss the
schedule computes on the last stage's output). The rest of the step the rank waited: its
bubble, to hold beside the plan's."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Iterator, Sequence

from europa.core.pipeline.kinds import STAGE_SEND_KIND
from europa.spec.tags import mark_traffic

COMPUTE = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
SENDS = ("get_fwd_send_ops", "get_bwd_send_ops")


class StageCounters:
    """Counts, from now on, what ``stages`` (torch ``PipelineStage``s) send and compute,
    by wrapping those methods on each stage object."""

    def __init__(self, stages: Sequence) -> None:
        self.sent_bytes = 0
        self.compute_s = 0.0
        self._in_pair = False
        for stage in stages:
            for name in COMPUTE:
                setattr(stage, name, self._timed(stage, name))
            for name in SENDS:
                setattr(stage, name, self._counted(getattr(stage, name)))

    def count_loss(self, schedule) -> None:
        """Count the loss ``schedule`` computes (torch's ``_compute_loss``, on the last
        stage's output) as computation: the plan counts it to the last stage."""
        schedule._compute_loss = functools.partial(self._timing, schedule._compute_loss)

    def reset(self) -> None:
        self.sent_bytes, self.compute_s = 0, 0.0

    @contextlib.contextmanager
    def pair_span(self) -> Iterator[None]:
        """Two chunks running side by side inside: timed as one span of computation, the
        chunks themselves not counted again."""
        started = time.perf_counter()
        self._in_pair = True
        try:
            yield
        finally:
            self._in_pair = False
            self.compute_s += time.perf_counter() - started

    def _timing(self, call: Callable, *args, **kwargs):
        """``call(*args, **kwargs)``, its time added to ``compute_s``."""
        if self._in_pair:  # counted as the pair's span
            return call(*args, **kwargs)
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.compute_s += time.perf_counter() - started

    def _timed(self, stage, name: str) -> Callable:
        @functools.wraps(getattr(stage, name))
        def timed(*args, **kwargs):
            # the class's method, looked up at each call: a wrapper installed there later
            # (europa-overlap's timeline records each chunk) runs too
            return self._timing(getattr(type(stage), name), stage, *args, **kwargs)

        return timed

    def _counted(self, method: Callable) -> Callable:
        @functools.wraps(method)
        def counted(*args, **kwargs):
            ops = method(*args, **kwargs)
            for op in ops:  # filed as the planner's kind by a counter of every send
                mark_traffic(op.tensor, STAGE_SEND_KIND)
            self.sent_bytes += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops

        return counted
