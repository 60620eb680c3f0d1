"""Position-independent caching.

``segments``: ``<pic>`` markup -> token ids and segments (pure Python, no torch: the router uses it too).
``rope_shift``: re-rotation of cached keys to new positions (torch).
Nothing is re-exported here so importing ``segments`` does not pull in torch.
"""
