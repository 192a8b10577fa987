"""The shared layer library every model family composes (``engine/models/``).

- ``prepared.py``: ``Prepared``, a module's matrices and their prepared products (packed for the
  model's linear kernel; the native kernel's packed copy may stand alone, ``release_plain``);
- ``attention.py``: ``Attention``, self-attention over the paged KV cache (fused QKV, optional
  per-head q/k norms, rope, a window, sinks or a softcap per layer, the output product);
- ``mlp.py``: ``GatedMLP``, the dense gate/up/down MLP (SiLU or tanh-GELU);
- ``moe.py``: ``MoE``, a router and its experts (each expert's products once per step for all of
  its tokens);
- ``decoder.py``: ``DecoderLayer``, the pre-norm layer (attention and MLP around two residual adds)
  with Gemma's sandwich norms as an option, and the fused native path where a layer allows it;
- ``context.py``: ``LayerContext``, what every layer is built with (dtype, device, TP shard and group,
  the norm function).

Tensor parallelism (``engine/tensor_parallel.py``): each module holds its rank's shard; row-parallel
products are summed over the group by the module that ends with one, and a row-parallel bias is added
on rank 0 only.
"""
