"""Replica-level fault tolerance (``[fault_tolerance]``): replica groups that train as jobs
of their own and meet through torchft (``groups``), and the Lighthouse that forms their
quorums (``lighthouse``)."""
