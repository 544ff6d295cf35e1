"""Serving engines: exporting a drafter to vLLM and SGLang (`osprey export`), the draft length per batch size that vLLM
serves it with (`vllm_schedule`), and tuning it on timed engines (`osprey tune`). `vllm_engine.py` is a script run in
vLLM's own environment: it imports nothing of the project.

May import every other part of `osprey`; nothing of `osprey` imports it.
"""
