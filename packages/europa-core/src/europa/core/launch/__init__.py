"""The launcher process and its supervision: ``europa train`` starting local workers or
running as one rank of a launcher's job (``launcher``), the worker entry point
(``worker``), nodes and restarts, interrupts and casualties, what each rank reports to it
(``progress``, ``faults``) and where this process stands (``distributed``)."""
