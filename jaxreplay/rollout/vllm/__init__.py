"""vLLM rollout engines: the engine and its process proxy (`engine`, no vLLM import at module
level), and what runs inside engine processes only: the weight-transfer engine and worker extension
(`transfer`) and the CPU direct re-pack (`direct_load`)."""
