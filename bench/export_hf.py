"""Write a GGUF model as a Hugging Face folder (config.json, model.safetensors, tokenizer files).

Other servers (vLLM's CPU build, transformers) can then load the very weights
pdserve serves: the GGUF tensors are dequantized to float32 by
``engine.gguf_loader`` (Q/K un-permuted to the HF layout) and saved under their HF
names; the tokenizer is the one pdserve builds from the GGUF metadata. Loading
the folder back with pdserve gives the same config and weights.

    python -m bench.export_hf [--model FILE.gguf] --output DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HF_CLASSES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
              "mistral": ("MistralForCausalLM", "mistral")}


def hf_config(config: Any) -> dict[str, Any]:
    """config.json contents for an ``engine.config.ModelConfig``."""
    cls, model_type = HF_CLASSES[config.architecture]
    rope = config.rope_scaling
    raw: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings, "attention_bias": config.attention_bias,
        "hidden_act": "silu", "torch_dtype": "float32",
    }
    if rope.rope_type != "default":
        raw["rope_scaling"] = {"rope_type": rope.rope_type, "factor": rope.factor,
                               "low_freq_factor": rope.low_freq_factor,
                               "high_freq_factor": rope.high_freq_factor,
                               "original_max_position_embeddings": rope.original_max_position_embeddings}
    if config.bos_token_id is not None:
        raw["bos_token_id"] = config.bos_token_id
    if config.eos_token_ids:
        raw["eos_token_id"] = list(config.eos_token_ids) if len(config.eos_token_ids) > 1 \
            else config.eos_token_ids[0]
    if config.sliding_window is not None:
        raw["sliding_window"] = config.sliding_window
    return raw


def export_hf(model: str | Path | None, output: Path) -> Path:
    """Write the HF folder for ``model`` (a .gguf file; default: the built-in model) into ``output``."""
    from safetensors.torch import save_file

    from engine.loader import load_model_source, resolve_model

    source = load_model_source(resolve_model(None if model is None else str(model)))
    if source.kind != "gguf":
        raise ValueError(f"--model: {source.path} is already a Hugging Face folder")
    output.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.contiguous() for name, t in source.iter_weights()}
    if source.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(output / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(source.config)
    (output / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (output / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    source.load_tokenizer().hf.save_pretrained(str(output))
    return output


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.export_hf", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, metavar="FILE",
                   help="a .gguf file (default: the built-in SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--output", type=Path, required=True, metavar="DIR", help="folder to write")
    args = p.parse_args(argv)
    try:
        out = export_hf(args.model, args.output)
    except (ValueError, FileNotFoundError) as exc:
        print(f"export_hf: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
