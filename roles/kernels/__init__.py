"""Kernels the FSDP actor's forward and backward may run instead of plain torch ops.

Library (not a role). It holds the packed (varlen) attention backends registered with
transformers (`varlen`: torch's, `varlen_cudnn`: cuDNN's, `varlen_fa4`: FlashAttention 4,
sharing the custom ops of `varlen_ops`); the chunked per-token logprob and entropy head
(`token_stats`) and its fused logit kernels (`logit_kernels`); and the RMSNorm / SwiGLU /
RoPE choice between transformers' own and Liger's (`block_kernels`). It imports no other
project package. Modules are imported by name; this package re-exports nothing.
"""
