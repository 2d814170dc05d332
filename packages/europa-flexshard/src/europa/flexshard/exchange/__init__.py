"""The expert exchange: tokens to the ranks owning their routed experts, outputs back.

Modules:

* ``dispatcher``: the base both dispatchers share (torchtitan's ``dispatch``/``combine``
  over the chunked ``begin``/``arrive``/``send_back``/``finish`` of europa-spec's
  ``ChunkedDispatcher``);
* ``flat``: one row per (token, expert) pair, straight to the expert's owner;
* ``two_level``: one row per (token, destination node) between nodes, then per (token,
  destination rank) inside the node;
* ``all_to_all``: one all-to-all of packed rows, with autograd, both dispatchers' only
  collective; ``codec``: a row's tensors as bytes on the wire and back;
* ``kept``: exchanges kept for a recomputation (activation checkpointing);
* ``nodes``: which ranks of an ep group share a node; ``routing``: where the split sizes
  come from (the routing tensors, or a routing model on fake tensors);
* ``wire`` and ``traffic``: the bytes an exchange sends, expected and exact (pure Python).

Notation. A tensor's name ends in its dimensions, one letter each, as in Megatron-core's
``token_dispatcher.py``:

* ``B``: sequences in the micro-batch; ``L``: tokens a sequence;
* ``T``: tokens, ``B * L`` flattened (this rank's, before the exchange);
* ``D``: the model dimension (a token's hidden state);
* ``K``: routing slots a token, ``top_k`` (each an expert id and its score);
* ``E``: experts (all of them, or this rank's local ones where the name says so);
* ``R``: rows received for this rank's experts, grouped by local expert.

So ``x_TD`` is ``[tokens, dim]``, ``ids_TK`` ``[tokens, top_k]`` and ``routed_output_RD``
the experts' outputs, one row per received (token, expert) pair.
"""
