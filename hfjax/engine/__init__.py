"""Engines that run the actor's programs: the rollout sampler (`sampler`, `buckets`,
`decode`, `token_select`, `continuous`), the 3D-HybridEngine that reshards the actor between its
training and decoding layouts (`hybrid`), and micro-batched update steps (`update`)."""

from hfjax.engine.buckets import bucket_size, prompt_bucket
from hfjax.engine.sampler import GenerateOutput, Sampler, SamplingParams, generate

__all__ = [
    "GenerateOutput", "Sampler", "SamplingParams", "bucket_size", "generate", "prompt_bucket",
]
