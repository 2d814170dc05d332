"""europa-spec: what europa-core and every technique package must agree on exactly.

The shape is that of an instrumentation API package: each technique package depends
on this small one, never on europa-core, and core depends on it too.

* ``europa.spec.hookspecs``: the hooks, their phases and order, and the hook markers;
* ``europa.spec.job``: what each phase's ``job`` offers a hook, as Protocols;
* ``europa.spec.plan_layout``: the plan's layout record, typed and validated in one place;
* ``europa.spec.metrics``: the metric names core's trainer writes;
* ``europa.spec.errors``: the user-error marker; ``europa.spec.tags``: tensor tags;
* ``europa.spec.muon``: Newton–Schulz, the Muon/AdamW parameter rule and the
  optimizer-state sizes; ``europa.spec.dcp``: the one chunk tensor for
  torch.distributed.checkpoint.

Everything but ``muon`` and ``dcp`` imports only the standard library and pluggy.
"""
