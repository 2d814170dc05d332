"""The fork server imports this before any europa module: torchtitan patched for CPU
ranks (``tests.torchtitan_cpu.titan``) before europa's modules import it, so that ranks
forked from the server can run torchtitan's own Trainer without a fresh interpreter.

The patch only makes torchtitan see the CPU it runs on (it would otherwise assume CUDA)
and changes nothing else that europa's own code uses."""

from tests.torchtitan_cpu import titan

titan()
