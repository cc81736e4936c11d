"""Functional Qwen3 / Qwen2.5 / Llama-3 models over parameter pytrees (see WORKSPACE.md): the
architecture record (`config`), the parameter layout table (`layout`), the forward (`transformer`),
KV-cache decoding (`decode`), chunked log-probs (`logprobs`), LoRA adapters (`lora`), Hugging Face
conversion and files (`hf_io`, `safetensors_io`) and the published architectures (`presets`)."""
