"""Attention chosen per shape: SDPA's backends (and external kernels where installed), measured on the GPU
under a fidelity check, the fastest kept (choice.py); the candidates (backends.py). The graph pass that
applies a choice is compiler/passes/choose_attention_backend.py."""
from .backends import BACKENDS, AttentionBackend
from .choice import FIDELITY_TOLERANCE, AttentionChoice, AttentionKey, choose, chosen_for

__all__ = ["BACKENDS", "AttentionBackend", "FIDELITY_TOLERANCE", "AttentionChoice", "AttentionKey", "choose",
           "chosen_for"]
