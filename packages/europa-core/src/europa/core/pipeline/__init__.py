"""Pipeline stages (``torch.distributed.pipelining``): the model cut into stages balanced
by compute (``cut``), each stage a copy of the model holding only its own layers
(``split``), and torch's schedules placed on the ranks (``schedules``)."""
