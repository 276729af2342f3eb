"""Inference: loading a model for it and its transforms (load.py), the one token Generator over a KV cache, the
sampler, the end rule and stop strings, the compiled decode, the CPU weight layouts, quantisation, constrained
decoding and chat templates.
"""
