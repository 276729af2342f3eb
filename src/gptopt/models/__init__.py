"""The model: GPT-2 and the Llama / Qwen3 block as switches of one module (gpt.py), its loss, FLOPs, Hugging Face
in and out (hf.py), and gptopt's own files (checkpoint.py, compressed.py).
"""
