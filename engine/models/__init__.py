"""The model families (one module each) and the decoder they build (``causal_lm.py``).

``registry.py`` lists the families; each family's module (``llama.py``, ``qwen3.py``, ``mixtral.py``,
``gemma3.py``, ``gpt_oss.py``) reads its Hugging Face config into a ``ModelConfig``, maps its
checkpoint's tensor names onto the layer library's (``engine/layers/``) and says how its model differs
at the ends (``family.py``). ``causal_lm.py``'s ``CausalLM`` composes the layer library for any
family: embeddings, the decoder layers, the final norm and the LM head.
"""
