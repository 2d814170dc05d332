"""Checkpoints: save and load through torch.distributed.checkpoint with the completion
marker and the resume choice (``store``), the restricted reader that trusts no pickled
code (``reader``), and the global batch a checkpoint was trained with (``global_batch``)."""
