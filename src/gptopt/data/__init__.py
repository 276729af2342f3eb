"""Data: tokenizers, corpora tokenized into train/val shards (corpus.py), the batches training draws from them
(loader.py), bits per byte (bpb.py).
"""
