"""``europa plan --execute``: a rank's real program of one step, run at the planned size on
fake tensors, its memory and traffic measured beside the plan's.

Design note. A plan is arithmetic; an execution runs the code. One process per executed
rank (``runner``) starts torch's ``fake`` process group at the planned world size (every
collective returns at once), builds the device mesh, and runs the trainer's own phases
through the hooks (``program``) under ``fake.FakeDeviceMode``: device tensors have shapes
and no storage, host index arithmetic runs for real. On a GPU plan the device is a
stand-in accelerator (``standin``) on which the GPU code paths run. The expert exchange's
split sizes, which a run reads from its routing, come from a routing model instead
(``europa.spec.execution``, ``europa.flexshard.exchange.routing``), the same on every rank, so ranks
executed apart agree. Two observers watch: ``ledger.MemoryLedger`` (every storage, by the
plan's memory terms, device and host) and ``traffic.TrafficCount`` (every byte sent, by the
plan's kinds and links); ``compare`` sets them beside the plan and ``report`` prints them.
"""
